"""What machine a benchmark ran on, and how busy it was: the CPU (model, vector units, cores
this process may use), the load average before and after, and a short fixed probe of memory
bandwidth and float32 GEMM rate — so that figures from different hours and hosts can be
compared (a figure from a noisy hour shows a low probe or a high load beside it).

`python -m pagedllm.benchmarks.machine` prints the record.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from pagedllm.backends.host import cpu_info

PROBE_BYTES = 64 << 20  # larger than the last-level cache of most hosts
GEMM_SIZE = 512


def time_steps(fn, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of fn."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def probe_rates() -> dict:
    """Memory bandwidth (GB/s, reading a 64 MiB buffer; one thread and all) and float32 GEMM
    rate (GFLOP/s, 512 x 512 x 512, all threads): the best of a few rounds, ~0.3 s in all."""
    import torch

    threads = torch.get_num_threads()
    buf = torch.ones(PROBE_BYTES // 4)
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    rates = {}
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            buf.sum()
            rates[f"memory_gb_s_{n}_threads"] = round(PROBE_BYTES / min(time_steps(buf.sum, 5)) / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
    a @ b
    rates["gemm_gflop_s"] = round(2 * GEMM_SIZE**3 / min(time_steps(lambda: a @ b, 10)) / 1e9, 1)
    return rates


def machine_record() -> dict:
    """The record at the start of a run; `finish` adds the load after it."""
    return {**cpu_info(), "load_before": round(os.getloadavg()[0], 2), **probe_rates()}


def finish(record: dict) -> dict:
    return {**record, "load_after": round(os.getloadavg()[0], 2)}


def describe(record: dict) -> str:
    """One line for a table's foot."""
    memory = ", ".join(f"{v} GB/s" for k, v in record.items() if k.startswith("memory_gb_s"))
    load = f"load {record['load_before']}" + (f" -> {record['load_after']}" if "load_after" in record else "")
    return (
        f"machine: {record['cpu']} ({' '.join(record['vector_flags']) or 'no vector flags'}), "
        f"{record['cores']} cores; {load}; memory {memory} (1 thread, all); GEMM {record['gemm_gflop_s']} GFLOP/s"
    )


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(busy: int = 0, timeout: float = 3.0, window: float = 0.1, cpu_times=_cpu_times) -> float:
    """Wait until the CPUs are about as idle as `busy` busy processes leave them (one `window`
    with less than busy + 0.25 cores' worth of work), at most `timeout` seconds; returns the
    seconds waited. A system's round must not meet the previous system's tail: vLLM's worker
    threads kept ~0.1-0.7 of a core busy for a second or so after its rounds, and pagedllm's
    next round, started at once, ran 26% slower beside it than alone (docs/bench). Where
    /proc/stat is missing (not Linux) it waits one window."""
    start = time.monotonic()
    try:
        cores = os.cpu_count() or 1
        before = cpu_times()
        while time.monotonic() - start < timeout:
            time.sleep(window)
            after = cpu_times()
            total = after[1] - before[1]
            if total > 0 and (after[0] - before[0]) / total * cores < busy + 0.25:
                break
            before = after
    except OSError:
        time.sleep(window)
    return time.monotonic() - start


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that keep a core busy each, as other work on a shared machine does."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    print(describe(finish(machine_record())))
