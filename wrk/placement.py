"""CPU placement for load runs on a small machine: the load generator and the backend on one CPU, the
system under test on another, as it would be in production (the load comes from elsewhere). One home for
wrk.protocol and the benchmarks in bench/ (which depend on wrk/, never the other way round).

    load_cpu, edge_args = place()      # call before starting nginx or the generator: they inherit it
"""

from __future__ import annotations

import os
import platform
import sys


def place() -> tuple[int | None, list[str]]:
    """Pin this process (and so the children it starts) to the first allowed CPU; return the
    --cpu-affinity arguments that put an edge on the last one. No-op on a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, []
    os.sched_setaffinity(0, {cpus[0]})
    return cpus[0], ["--cpu-affinity", str(cpus[-1])]


def describe(load_cpu: int | None, edge_args: list[str]) -> str:
    if load_cpu is None:
        return "one CPU: generator, backend and edge share it"
    return (f"generator and backend pinned to CPU {load_cpu}, the edge to CPU {edge_args[-1]} "
            f"(`{' '.join(edge_args)}`)")


def machine() -> str:
    """The CPU and the interpreter, for a sitting's header: a ratio to nginx's CPU per request follows the
    host's speed at interpreted code (docs/performance.md, fourteenth stop), so it needs its host beside it."""
    model = mhz = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "cpu MHz" and not mhz:
                    mhz = f" {float(value):,.0f} MHz"
    except (OSError, ValueError):
        pass
    # which build, by path (its configure flags don't say: Debian's PGO+LTO build shows neither)
    return (f"{model or platform.processor() or platform.machine()}{mhz}, {os.cpu_count()} CPUs; "
            f"Python {platform.python_version()} ({os.path.realpath(sys.executable)})")
