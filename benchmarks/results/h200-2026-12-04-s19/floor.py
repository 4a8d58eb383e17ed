"""Vulkan dispatch floor: N back-to-back dependent copies (each writes y) of S bytes through
llmchat's device API; host record time, then the wait for the GPU after one submit."""
import json, sys, time
sys.path.insert(0, ".")
import numpy as np
import tvm
from app.inference.backends import webgpu

dev = webgpu.device(0)
lib = tvm.runtime.load_module(sys.argv[1])
sync = tvm.get_global_func("llmchat.webgpu.sync")
for rows in (64, 1024, 16384, 65536, 262144, 1048576, 4194304):
    x = tvm.runtime.tensor(np.ones((rows, 4), "float32"), dev)
    y = tvm.runtime.empty((rows, 4), "float32", dev)
    n = 2000 if rows <= 65536 else 400 if rows <= 1048576 else 100
    for _ in range(20):
        lib["copy"](x, y)
    sync(0)
    best = None
    for rep in range(3):
        a = webgpu.stats(0)
        t0 = time.perf_counter()
        for _ in range(n):
            lib["copy"](x, y)
        t1 = time.perf_counter()
        sync(0)
        t2 = time.perf_counter()
        b = webgpu.stats(0)
        r = {"bytes_moved": rows * 32, "dispatches": n, "host_loop_us": round((t1 - t0) / n * 1e6, 3),
             "wait_us_per_dispatch": round((t2 - t1) / n * 1e6, 3),
             "total_us_per_dispatch": round((t2 - t0) / n * 1e6, 3),
             "submit_us": round((b["submit_ns"] - a["submit_ns"]) / n / 1e3, 3),
             "wait_ns_counter_us": round((b["wait_ns"] - a["wait_ns"]) / n / 1e3, 3)}
        if best is None or r["wait_us_per_dispatch"] < best["wait_us_per_dispatch"]:
            best = r
    best["TBps_at_wait"] = round(rows * 32 / (best["wait_us_per_dispatch"] * 1e-6) / 1e12, 3)
    print(json.dumps(best), flush=True)
