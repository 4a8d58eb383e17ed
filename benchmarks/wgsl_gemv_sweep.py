"""Schedule variants of the q4f16_1 decode GEMV in WGSL, compiled here, timed on a Vulkan GPU.

The Llama-2-7B shape's decode GEMVs (qkv 4096->12288, o 4096->4096, gate+up 4096->22016,
down 11008->4096, lm head 4096->32000) in several schedules of llmchat's ``DecodeGEMV`` rule
(threads per row, rows per workgroup, weight-load width, loads in flight, the vector staged in
workgroup memory), accumulating in fp32 as the product does, each for the profile
``wgsl-f16-wg49152-t256`` (workgroup-memory reductions) and its ``-sg32`` twin (subgroup-shuffle
reductions); variant ``current`` is what the product compiles today for that profile (its dlight
rule list), ``dlight`` dlight's GEMV, ``dlight-f16acc`` dlight's GEMV with the products and sum in
fp16 (MLC's q4f16_1 decode; ``DecodeGEMV`` on an fp16 sum hits an internal error in TVM 0.27's
StorageRewrite, so it is not in the sweep). Threads per row above 32 split K inside the workgroup
(partial sums of several subgroups merged through workgroup memory); a K split across
workgroups (a second kernel) is not in the sweep. Variants that do not fit a shape (rows that
do not tile, more than 48 KiB of workgroup memory) are left out of it, with the reason.

Here (the TVM compiler, no GPU):
    python benchmarks/wgsl_gemv_sweep.py compile --out scratch/gemv_sweep
On the H200 (device tool, kind nvidia-h200, timeout_s 600; carry [".whl", ".gl", "scratch/gemv_sweep"]
and, for the script's optional whole-model A/B, "scratch/vk_sg", "scratch/vk_plain" (its header
says how to build them); runtime-only TVM, NVIDIA's Vulkan driver):
    bash benchmarks/run_h200_gemv_sweep.sh scratch/gemv_sweep "$OUT"
which installs the carried wheels and Vulkan loader, builds llmchat's add-on, then runs
    python3 benchmarks/wgsl_gemv_sweep.py run --dir scratch/gemv_sweep --out "$OUT/gemv_sweep.json"
(checks every variant against numpy, fails loudly on a wrong result; then times 3 x 200 launches
per variant, each batch recorded and submitted at once, weights rotated over enough copies to
miss the L2 cache; prints µs and GB/s per shape and variant and the best per shape).
Here on lavapipe, for correctness only: ``run --dir DIR --out JSON --quick`` (or ``--check-only``:
one launch per variant, no timing; ``--shapes``, ``--variants`` take comma-separated subsets).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.inference.pipelines import wgsl_gemv  # the repository is on the path now

PROFILES = ("wgsl-f16-wg49152-t256", "wgsl-f16-wg49152-t256-sg32")
#: (name, in_features K, out_features N) of Llama-2-7B's decode GEMVs
SHAPES = (
    ("qkv", 4096, 12288),
    ("o", 4096, 4096),
    ("gate_up", 4096, 22016),
    ("down", 11008, 4096),
    ("lm_head", 4096, 32000),
)
#: the decode GEMVs of the Qwen2.5 shapes (``--shapes`` names them; not in the default set)
QWEN_SHAPES = (
    ("q05-qkv", 896, 1152),
    ("q05-o", 896, 896),
    ("q05-gate_up", 896, 9728),
    ("q05-down", 4864, 896),
    ("q05-lm_head", 896, 151936),
    ("q3-qkv", 2048, 2560),
    ("q3-o", 2048, 2048),
    ("q3-gate_up", 2048, 22016),
    ("q3-down", 11008, 2048),
    ("q3-lm_head", 2048, 151936),
)
#: the variants: app/inference/pipelines/wgsl_gemv.py's family (its docstring names the layouts),
#: then llmchat's hand-scheduled kernel (app/inference/pipelines/wgsl_q4_gemv.py) in several layouts
VARIANTS = {**wgsl_gemv.VARIANTS, **{name: {"q4": True} for name in wgsl_gemv.Q4_SWEEP}}
TOLERANCE = {False: 1e-2, True: 3e-2}  # of max |reference|, for fp32 / fp16 accumulation


def _gemv_f32(in_f: int, out_f: int) -> Any:
    """The product's decode GEMV PrimFunc of one q4f16_1 linear layer (exported as the model
    exports it, legalized and fused like the GPU pipeline does)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from app.inference.pipelines import gpu
    from app.inference.quantization import get_format

    fmt = get_format("q4f16_1")

    class Proj(nn.Module):
        def __init__(self) -> None:
            self.proj = fmt.linear(in_f, out_f, bias=False, dtype=fmt.model_dtype)

        def decode(self, x: Any) -> Any:
            return self.proj(x)

    spec = {
        "decode": {
            "x": nn.spec.Tensor([1, 1, in_f], "float16"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, _ = Proj().export_tvm(spec=spec)
    mod = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            gpu.fast_decode_pass(),
        ]
    )(mod)
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(funcs) != 1:
        raise SystemExit(f"expected one GEMV kernel for {in_f}->{out_f}, found {len(funcs)}")
    return funcs[0]


def _gemv_f16(in_f: int, out_f: int) -> Any:
    """The same GEMV with the products and the sum in float16 (as MLC's q4f16_1 decode does)."""
    from tvm import te

    x = te.placeholder((1, 1, in_f), "float16", name="x")
    w = te.placeholder((out_f, in_f // 8), "uint32", name="weight")
    s = te.placeholder((out_f, in_f // 32), "float16", name="scale")
    k = te.reduce_axis((0, in_f), name="k")

    def value(n: Any, kk: Any) -> Any:
        nib = (w[n, kk // 8] >> ((kk % 8) * 4).astype("uint32")) & te.const(15, "uint32")
        return (nib.astype("float16") - te.const(7, "float16")) * s[n, kk // 32]

    out = te.compute((1, 1, out_f), lambda a, b, n: te.sum(x[a, b, k] * value(n, k), axis=k), name="gemv")
    return te.create_prim_func([x, w, s, out])


def _schedule(func: Any, target: Any, name: str) -> Any | None:
    from tvm.s_tir import dlight as dl

    from app.inference.pipelines import gpu

    if name == "current":
        rules = gpu.schedule_rules(target)
    elif name.startswith("dlight"):
        rules = [dl.gpu.GEMV()]
    else:
        rules = [wgsl_gemv.rule(name)]
    import tvm

    mod = tvm.IRModule({"main": func})
    with target:
        out = dl.ApplyDefaultSchedule(*rules)(mod)
    scheduled = out["main"]
    if "blockIdx" not in scheduled.script() and "threadIdx" not in scheduled.script():
        return None  # no rule took it
    return scheduled


def cmd_compile(args: argparse.Namespace) -> int:
    import tvm
    import tvm_ffi

    from app.inference.backends import webgpu
    from app.inference.pipelines.wgsl_subgroups import tir_pipeline

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    shapes += [s for s in QWEN_SHAPES if args.shapes and s[0] in args.shapes.split(",")]
    manifest: dict[str, Any] = {"shapes": [], "profiles": list(PROFILES), "variants": VARIANTS}
    for shape, in_f, out_f in shapes:
        base = {False: _gemv_f32(in_f, out_f), True: _gemv_f16(in_f, out_f)}
        for profile in PROFILES:
            if args.profiles and profile not in args.profiles.split(","):
                continue
            target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile=profile))
            entries: list[dict[str, Any]] = []
            seen: dict[int, dict[str, Any]] = {}
            names = ("current", "dlight", "dlight-f16acc", *VARIANTS)
            if args.variants:
                names = tuple(n for n in names if n in args.variants.split(","))
            for name in names:
                f16acc = name.endswith("f16acc")
                try:
                    scheduled = _schedule(base[f16acc], target, name)
                except Exception as err:  # a rule that does not fit this shape
                    print(f"  {shape} {profile} {name}: not scheduled ({type(err).__name__}: {err})")
                    continue
                if scheduled is None:
                    print(f"  {shape} {profile} {name}: no rule took it")
                    continue
                key = tvm_ffi.structural_hash(scheduled)
                if key in seen:  # the same kernel as an earlier variant
                    seen[key]["aliases"].append(name)
                    continue
                symbol = "gemv_" + name.replace("-", "_")
                lib_name = f"{shape}-{profile}-{name}.so"
                t0 = time.perf_counter()
                try:
                    lib = tvm.compile(
                        tvm.IRModule({symbol: scheduled.with_attr("global_symbol", symbol)}),
                        target=target,
                        tir_pipeline=tir_pipeline(target),
                    )
                except Exception as err:  # TVM cannot lower this schedule
                    first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else ""
                    why = f"{type(err).__name__}: {first}"
                    print(f"  {shape} {profile} {name}: TVM could not compile it ({why})")
                    continue
                src = "\n".join(m.inspect_source() for m in lib.mod.imports)
                if profile.endswith("-sg32") and "enable subgroups;" not in src:
                    raise SystemExit(f"{lib_name}: the -sg32 kernel has no subgroup operations")
                lib.export_library(str(out / lib_name))
                entry = {
                    "variant": name,
                    "symbol": symbol,
                    "lib": lib_name,
                    # fp16 sums, or int8-rounded activations: the looser tolerance
                    "f16acc": f16acc or name.endswith("-dp4a"),
                    "subgroup_ops": "subgroupShuffle" in src,
                    "aliases": [],
                }
                seen[key] = entry
                entries.append(entry)
                print(
                    f"{lib_name}: {time.perf_counter() - t0:.1f} s, "
                    f"{(out / lib_name).stat().st_size / 1e3:.0f} kB"
                    + ("" if "subgroup" not in src else ", subgroup shuffles")
                )
            manifest["shapes"].append(
                {
                    "shape": shape,
                    "in_features": in_f,
                    "out_features": out_f,
                    "profile": profile,
                    "kernels": entries,
                }
            )
    # the launch floor: a one-thread kernel, timed like the GEMVs
    from tvm import te

    a = te.placeholder((1,), "float16", name="a")
    b = te.compute((1,), lambda i: a[i], name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]).with_attr("global_symbol", "noop"))
    (i,) = sch.get_loops(sch.get_sblock("b"))
    sch.bind(i, "threadIdx.x")
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile=PROFILES[0]))
    tvm.compile(sch.mod, target=target).export_library(str(out / "noop.so"))
    manifest["noop"] = "noop.so"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {total / 1e6:.1f} MB")
    return 0


def _reference(x: Any, w: Any, s: Any) -> Any:
    """out[n] = sum_k x[k] * (nibble(w, n, k) - 7) * s[n, k // 32], in float32, by row chunks."""
    import numpy as np

    n_rows = w.shape[0]
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    xf = x.reshape(-1).astype(np.float32)
    out = np.empty(n_rows, dtype=np.float32)
    for r in range(0, n_rows, 2048):
        nib = ((w[r : r + 2048, :, None] >> shifts) & 15).reshape(w[r : r + 2048].shape[0], -1)
        deq = (nib.astype(np.float32) - 7.0) * np.repeat(s[r : r + 2048].astype(np.float32), 32, axis=1)
        out[r : r + 2048] = deq @ xf
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np
    import tvm

    from app.inference.backends import webgpu

    root = Path(args.dir)
    manifest = json.loads((root / "manifest.json").read_text())
    dev = webgpu.device(0)
    adapter = webgpu.adapters()[0]
    sg = webgpu.subgroup_size(adapter)
    if not sg and args.assume_subgroup and adapter.subgroups:
        sg = args.assume_subgroup
        print(f"assuming {sg}-wide subgroups (--assume-subgroup): the adapter reports no fixed size")
    print(
        f"adapter: {adapter.name} ({adapter.driver}); subgroups {adapter.subgroups}, sizes "
        f"{adapter.subgroup_min_size}..{adapter.subgroup_max_size}; profile {webgpu.Profile.of(adapter)}"
    )
    sync = tvm.get_global_func("llmchat.webgpu.sync")
    rng = np.random.default_rng(0)
    launches, repeats = (3, 1) if args.quick else (args.launches, args.repeats)
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    wrong: list[str] = []  # computed a wrong result
    failed: list[str] = []  # did not load or run
    inputs: dict[tuple[int, int], Any] = {}
    for entry in manifest["shapes"]:
        if args.shapes and entry["shape"] not in args.shapes.split(","):
            continue
        profile = entry["profile"]
        if profile.endswith("-sg32") and sg != 32:
            why = f"the adapter has no fixed 32-wide subgroups (size {sg or 'varies/none'})"
            skipped.append(f"{entry['shape']} {profile}: {why}")
            print("SKIPPED", skipped[-1])
            continue
        k, n = entry["in_features"], entry["out_features"]
        if (k, n) not in inputs:
            inputs.clear()  # one shape's buffers at a time
            x = rng.standard_normal((1, 1, k)).astype(np.float16)
            w = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint64).astype(np.uint32)
            s = (rng.uniform(0.5, 1.5, size=(n, k // 32)) * 0.02).astype(np.float16)
            ref = _reference(x, w, s)
            weight_bytes = w.nbytes + s.nbytes
            # enough copies of the weights to miss the L2 cache (H200: 60 MiB) between launches
            copies = 1 if args.quick else max(2, math.ceil(args.rotate_mb * 2**20 / weight_bytes))
            wd = [tvm.runtime.tensor(w, dev)] + [tvm.runtime.tensor(w, dev) for _ in range(copies - 1)]
            sd = [tvm.runtime.tensor(s, dev)] + [tvm.runtime.tensor(s, dev) for _ in range(copies - 1)]
            xd = tvm.runtime.tensor(x, dev)
            od = tvm.runtime.empty((1, 1, n), "float16", dev)
            inputs[(k, n)] = (x, ref, wd, sd, xd, od, weight_bytes + x.nbytes + n * 2)
        x, ref, wd, sd, xd, od, moved = inputs[(k, n)]
        for kern in entry["kernels"]:
            label = f"{entry['shape']} {profile} {kern['variant']}"
            if args.variants and kern["variant"] not in args.variants.split(","):
                continue
            try:
                lib = tvm.runtime.load_module(str(root / kern["lib"]))
                fn = lib[kern["symbol"]]
                od.copyfrom(np.full((1, 1, n), np.nan, dtype=np.float16))
                fn(xd, wd[0], sd[0], od)
                got = od.numpy().reshape(-1).astype(np.float32)
            except Exception as err:  # a shader the driver refuses: say which, go on
                failed.append(f"{label}: {type(err).__name__}: {str(err).strip()[:300]}")
                print("FAILED", failed[-1], flush=True)
                continue
            err = float(np.max(np.abs(got - ref)))
            scale = float(np.max(np.abs(ref)))
            limit = TOLERANCE[bool(kern["f16acc"])] * scale
            if not np.isfinite(got).all() or err > limit:
                bad = int(np.argmax(np.abs(got - ref)))
                wrong.append(
                    f"{label}: max |error| {err:.4g} > {limit:.4g} "
                    f"(row {bad}: got {got[bad]!r}, numpy {ref[bad]!r})"
                )
                print("WRONG RESULT", wrong[-1], flush=True)
                continue
            if args.check_only:
                print(f"{label}: matches numpy (max relative error {err / scale:.1e})", flush=True)
                continue
            best = math.inf
            for i in range(launches // 10 or 1):  # warm-up
                fn(xd, wd[i % len(wd)], sd[i % len(sd)], od)
            sync(0)
            for _ in range(repeats):
                t0 = time.perf_counter()
                for i in range(launches):
                    fn(xd, wd[i % len(wd)], sd[i % len(sd)], od)
                sync(0)
                best = min(best, (time.perf_counter() - t0) / launches)
            row = {
                "shape": entry["shape"],
                "in_features": k,
                "out_features": n,
                "profile": profile,
                "variant": kern["variant"],
                "aliases": kern["aliases"],
                "us": round(best * 1e6, 3),
                "GBps": round(moved / best / 1e9, 1),
                "max_rel_error": round(err / scale, 6),
            }
            results.append(row)
            print(
                f"{row['shape']:8s} {profile:28s} {row['variant']:24s} {row['us']:10.2f} µs "
                f"{row['GBps']:8.1f} GB/s  err {row['max_rel_error']:.1e}",
                flush=True,
            )
    floor = None
    if manifest.get("noop"):
        noop = tvm.runtime.load_module(str(root / manifest["noop"]))["noop"]
        a = tvm.runtime.tensor(np.ones(1, dtype=np.float16), dev)
        b = tvm.runtime.empty((1,), "float16", dev)
        noop(a, b)
        if float(b.numpy()[0]) != 1.0:
            raise SystemExit("WRONG RESULT: the one-thread copy kernel did not copy")
        floor = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(launches):
                noop(a, b)
            sync(0)
            floor = min(floor, (time.perf_counter() - t0) / launches)
        floor = round(floor * 1e6, 3)
        print(f"launch floor (a one-thread kernel, {launches} launches per submission): {floor} µs")
    best_per_shape: dict[str, Any] = {}
    for r in results:
        b = best_per_shape.get(r["shape"])
        if b is None or r["us"] < b["us"]:
            best_per_shape[r["shape"]] = r
    current = {(r["shape"], r["profile"]): r for r in results if r["variant"] == "current"}
    print("\nbest per shape (against the product's current schedule, profile without subgroups):")
    for shape, r in best_per_shape.items():
        cur = current.get((shape, PROFILES[0]))
        speedup = f"{cur['us'] / r['us']:.2f}x current" if cur else ""
        figures = f"{r['us']:9.2f} µs {r['GBps']:8.1f} GB/s"
        print(f"  {shape:8s} {r['profile']:28s} {r['variant']:24s} {figures}  {speedup}")
    print("\nbest per shape and profile (the current schedule of that profile after it):")
    for shape in best_per_shape:
        for profile in PROFILES:
            mine = [r for r in results if r["shape"] == shape and r["profile"] == profile]
            if not mine:
                continue
            r = min(mine, key=lambda row: row["us"])
            cur = current.get((shape, profile))
            tail = f"current {cur['us']:9.2f} µs" if cur else ""
            figures = f"{r['us']:9.2f} µs {r['GBps']:8.1f} GB/s"
            print(f"  {shape:8s} {profile:28s} {r['variant']:24s} {figures}  {tail}")
    report = {
        "adapter": adapter.as_dict(),
        "launches": launches,
        "repeats": repeats,
        "quick": bool(args.quick),
        "skipped": skipped,
        "launch_floor_us": floor,
        "wrong": wrong,
        "failed": failed,
        "results": results,
        "best_per_shape": best_per_shape,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    for line in wrong:
        print("WRONG RESULT", line)
    for line in failed:
        print("FAILED", line)
    if wrong or failed:
        print(f"{len(wrong)} variants computed wrong results, {len(failed)} failed: see above")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile the variants (needs the TVM compiler)")
    c.add_argument("--out", required=True)
    c.add_argument("--shapes", default="", help="comma-separated subset of " + ",".join(s[0] for s in SHAPES + QWEN_SHAPES))
    c.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    c.add_argument("--profiles", default="", help="comma-separated subset of " + ",".join(PROFILES))
    r = sub.add_parser("run", help="check and time the variants on Vulkan adapter 0")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--shapes", default="")
    r.add_argument("--variants", default="", help="comma-separated subset of the variants")
    r.add_argument("--launches", type=int, default=200)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--rotate-mb", type=int, default=256, help="weight copies rotated (MiB in all)")
    r.add_argument("--quick", action="store_true", help="few launches, one weight copy (lavapipe)")
    r.add_argument("--check-only", action="store_true", help="check every variant against numpy, no timing")
    r.add_argument(
        "--assume-subgroup",
        type=int,
        default=0,
        help="run the -sgN kernels with this subgroup size where the adapter does not report one "
        "(an experiment: every result is still checked against numpy)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"compile": cmd_compile, "run": cmd_run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
