"""Timed benchmark phases on a shared machine: wait until it is quiet, record how quiet it was.

These machines are shared (two cores, other jobs, our own test runs). A benchmark that builds
models for an hour and times them for ten minutes should time them only when nothing else
runs, and say what the load was while it timed. `quiet_phase` does both: it waits until the
one-minute load average (`os.getloadavg`, which counts runnable threads of every process)
falls below a threshold, then measures the machine's peaks (matmul rate and read bandwidth,
`jaxinfer.bench.roofline.measure_peaks`) so the timings can be judged against this
session's CPU, and when the phase ends records the load again.

Our own process is idle while it waits (sleeping), so it does not hold the average up. Two
benchmarks waiting at once would both see the machine go quiet and start together, so a
phase first takes an exclusive lock (`LOCK_PATH`, `fcntl.flock`): timed phases of different
benchmarks run one after the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

LOCK_PATH = "/tmp/jaxinfer-timed-phase.lock"


def load_average() -> float:
    """The one-minute load average (runnable threads, all processes)."""
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, timeout_s: float, poll_s: float = 10.0) -> dict[str, Any]:
    """Sleeps until the one-minute load average is below `max_load` or `timeout_s` passes.

    Returns:
        `{"waited_s", "load_at_start", "quiet"}`: `quiet` is False when the wait timed out
        (the phase then runs anyway and the record says so).
    """
    started = time.monotonic()
    while True:
        load = load_average()
        if load < max_load or time.monotonic() - started >= timeout_s:
            return {"waited_s": round(time.monotonic() - started, 1),
                    "load_at_start": round(load, 2), "quiet": load < max_load}
        print(f"[{time.strftime('%H:%M:%S')}] load {load:.2f} >= {max_load}: waiting for a "
              "quiet machine before the timed phase", file=sys.stderr, flush=True)
        time.sleep(poll_s)


@contextlib.contextmanager
def quiet_phase(max_load: float = 0.5, timeout_s: float = 3600.0) -> Iterator[dict[str, Any]]:
    """Runs the body once the machine is quiet; fills the yielded record with the wait, the
    load at start and end, the UTC times, and the machine's measured peaks."""
    from jaxinfer.bench.roofline import measure_peaks

    with open(LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another benchmark's timed phase runs first
        record = wait_for_quiet(max_load, timeout_s)
        record["max_load"] = max_load
        record["started_utc"] = time.strftime("%H:%M", time.gmtime())
        peaks = measure_peaks()
        record["matmul_gflops"] = round(peaks.matmul_flops / 1e9, 1)
        record["read_gb_per_s"] = round(peaks.read_bytes / 1e9, 1)
        yield record
        record["ended_utc"] = time.strftime("%H:%M", time.gmtime())
        record["load_at_end"] = round(load_average(), 2)


def describe(record: dict[str, Any]) -> str:
    """One sentence for a results file: when the timed phase ran and how loaded it was."""
    state = ("quiet" if record["quiet"] else
             f"NOT quiet (the wait for load < {record['max_load']} timed out)")
    return (f"Timed phase {record['started_utc']}-{record['ended_utc']} UTC, machine {state}: "
            f"one-minute load average {record['load_at_start']} at its start (after waiting "
            f"{record['waited_s']:.0f} s for < {record['max_load']}) and "
            f"{record['load_at_end']} at its end (the benchmark's own threads included); "
            f"peaks measured at its start: {record['matmul_gflops']} GFLOP/s float32 matmul, "
            f"{record['read_gb_per_s']} GB/s read.")
