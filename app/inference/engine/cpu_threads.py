"""How many threads TVM's CPU thread pool gets (``TVM_NUM_THREADS``): one per physical core."""

from __future__ import annotations

import os


def default_cpu_threads() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores: set[str] = set()
    for cpu in cpus:
        try:
            path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
            with open(path, encoding="ascii") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def configure_cpu_threads(threads: int | None = None) -> int:
    """Set the size of TVM's CPU thread pool (``TVM_NUM_THREADS``) and return it.

    Call it before the first kernel runs: TVM sizes its pool once, on the first parallel loop.
    TVM's own default halves the logical CPU count (it assumes two hyper-threads per core), which
    leaves one of two real cores idle on small VMs. A value the user already put in
    ``TVM_NUM_THREADS`` wins unless ``threads`` is given."""
    if threads is None:
        env = os.environ.get("TVM_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) > 0:
            return int(env)
        threads = default_cpu_threads()
    os.environ["TVM_NUM_THREADS"] = str(max(1, int(threads)))
    return int(os.environ["TVM_NUM_THREADS"])
