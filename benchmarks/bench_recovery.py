"""Worker recovery: how long requests pause when the worker is SIGKILLed mid-generation, and how
much computed KV the shared-memory pool saved from being recomputed.

    python -m pagedllm.benchmarks.bench_recovery [--requests 16] [--kills 3] [--model DIR]

Streams the requests through the asyncio frontend (the demo model by default); after each
kill, the pause is the longest gap between two tokens (of any request) around the kill: from
the last token before the streams stalled to the first after the replacement took over.
"Kept" is the computed tokens (prompts and outputs so far) the replacement did not recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import time


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _worker_pid(core_pid: int) -> int:
    """The worker: a child of the core's worker launcher."""
    return next(w for launcher in _children(core_pid) for w in _children(launcher))


async def run(model: str | None, requests: int, kills: int, max_tokens: int) -> tuple[list[float], object]:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(model=model, max_worker_restarts=kills, kv_cache_memory="256MiB")
    token_times: list[float] = []
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def one(i: int):
            async for out in engine.generate(f"Request {i}: the for statement", params):
                if out.delta_token_ids:
                    token_times.append(time.monotonic())

        tasks = [asyncio.create_task(one(i)) for i in range(requests)]
        kill_times = []
        for _ in range(kills):
            await asyncio.sleep(2.0)
            kill_times.append(time.monotonic())
            os.kill(_worker_pid(engine.engine.pid), signal.SIGKILL)
            await asyncio.sleep(0.2)
            while engine.recovering is not None or token_times[-1] < kill_times[-1] + 0.2:
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        times = sorted(token_times)
        pauses = []
        for killed in kill_times:
            around = [t for t in times if killed - 1.0 <= t <= killed + 15.0]
            pauses.append(max(b - a for a, b in itertools.pairwise(around)))
        return pauses, engine.last_stats
    finally:
        engine.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    args = ap.parse_args(argv)
    pauses, stats = asyncio.run(run(args.model, args.requests, args.kills, args.max_tokens))
    print(f"{args.requests} streaming requests, {args.kills} kills of the worker:")
    print(f"  pause in the streams: {', '.join(f'{p:.2f}' for p in pauses)} s (median {statistics.median(pauses):.2f})")
    print(f"  restarts {stats.worker_restarts}; computed tokens kept, not recomputed: {stats.recovered_tokens}")


if __name__ == "__main__":
    main()
