"""How long a landed Redis flight takes to give its callers back, with and without a thread that keeps
taking the GIL back (limiter/redis/batch.py's wake-ups, checkout against checkout).

    python3 bench/flight_wakeups.py                                   # this checkout
    python3 bench/flight_wakeups.py --variant relay=/tmp/edge-relay --variant now=.
    taskset -c 1 python3 bench/flight_wakeups.py ...                  # one CPU, as --cpu-affinity auto runs it

N callers queue behind a flight held in the air (a Batcher with one flight and a fly() that answers at
once: no Redis, the wake-ups alone), then it lands; what is timed is from the landing to the last of them
being back from call(), each having then done ~50 µs of Python and a system call (its request's own
work). The busy thread stands for a connection relaying a large body: 1 ms of Python, a system call (it
drops the GIL and takes it straight back), again. A thread waiting for the GIL asks for it only when
nobody took it for the switch interval, so behind such a thread one waiting thread can wait long; N
woken at once get through sooner than N woken one after another. Medians and the worst of --rounds
flights; variants run in separate processes, alternating.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def one_flight(batch_module, n: int, busy: bool) -> float:
    """Seconds from the landing of a flight of n queued callers to the last of them being back."""
    flights: list[int] = []
    hold = threading.Event()
    landed = [0.0]
    back: list[float] = []
    devnull = os.open(os.devnull, os.O_WRONLY)

    def fly(calls):
        flights.append(len(calls))
        if len(flights) == 1:
            hold.wait(30)
        for c in calls:
            c.reply = c.cmd
        landed[0] = time.perf_counter()

    b = batch_module.Batcher(fly, 1)

    def caller() -> None:
        b.call(None, b"x")
        t = time.perf_counter()
        x = 0
        for _ in range(500):  # the request's own work, then its response's system call
            x += 1
        os.write(devnull, b"x")
        back.append(t)

    stop = threading.Event()

    def busy_thread() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.001:
                pass
            os.write(devnull, b"y")

    first = threading.Thread(target=caller, daemon=True)
    first.start()
    while not flights:
        time.sleep(0.001)
    ts = [threading.Thread(target=caller, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 30
    while len(b._queue) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    hog = threading.Thread(target=busy_thread, daemon=True)
    if busy:
        hog.start()
        time.sleep(0.01)
    hold.set()
    end = time.monotonic() + 30
    for t in [first, *ts]:
        t.join(max(0.0, end - time.monotonic()))
    stop.set()
    if busy:
        hog.join()
    os.close(devnull)
    if len(back) < n + 1:
        return float("inf")  # not all back within 30 s
    return max(back) - landed[0]


def child(checkout: Path, n: int, rounds: int, busy: bool) -> dict:
    spec = importlib.util.spec_from_file_location("batch_under_test", checkout / "limiter" / "redis" / "batch.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return {"s": [one_flight(m, n, busy) for _ in range(rounds)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="NAME=DIR (default: this checkout)")
    ap.add_argument("--callers", type=int, default=32, help="callers of the flight (default 32)")
    ap.add_argument("--rounds", type=int, default=10, help="flights per variant and case (default 10)")
    ap.add_argument("--child", nargs=4, metavar=("DIR", "N", "ROUNDS", "BUSY"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(Path(a.child[0]), int(a.child[1]), int(a.child[2]), a.child[3] == "1")))
        return
    variants = [v.partition("=")[::2] for v in a.variant or ["this=."]]
    print(f"# {a.callers} callers per flight, {a.rounds} flights per case; CPUs {sorted(os.sched_getaffinity(0))}")
    print("| variant | busy thread | median ms | worst ms |\n|---|---|---:|---:|")
    for busy in (False, True):
        for name, where in variants:
            r = subprocess.run([sys.executable, __file__, "--child", str(Path(where).resolve()), str(a.callers),
                                str(a.rounds), "1" if busy else "0"], capture_output=True, text=True, timeout=3600)
            if r.returncode:
                sys.exit(f"{name}: {r.stderr[-2000:]}")
            s = json.loads(r.stdout)["s"]
            worst = max(s)
            shown = "not all back in 30 s" if worst == float("inf") else f"{worst * 1e3:.1f}"
            print(f"| {name} | {'yes' if busy else 'no'} | {statistics.median(s) * 1e3:.2f} | {shown} |")


if __name__ == "__main__":
    main()
