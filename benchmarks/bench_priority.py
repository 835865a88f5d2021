"""Two priority classes under load: how soon the high class gets its first token with fcfs,
with priority ordering alone, and with priority preemption (a waiting request preempts
running ones of lower priority).

    python -m pagedllm.benchmarks.bench_priority [--requests 96] [--rate 12] [--model DIR]

One seeded workload, the same in every configuration: Poisson arrivals; a quarter of the
requests are "high" (priority 0, short prompts, 16 tokens: interactive), the rest "low"
(priority 1, longer prompts, 160 tokens: batch work). `max_num_seqs` is kept small so that the
engine is full and requests queue, which is when the policy matters.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from . import report
from .workload import poisson_arrivals

CONFIGS = {
    "fcfs": dict(scheduler_policy="fcfs"),
    "priority, no preemption": dict(scheduler_policy="priority", priority_preemption=False),
    "priority, preemption": dict(scheduler_policy="priority", priority_preemption=True),
}


def workload(num: int, seed: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        high = i % 4 == 0
        length = rng.randrange(16, 48) if high else rng.randrange(64, 192)
        out.append(("high" if high else "low", [rng.randrange(5, 400) for _ in range(length)], 16 if high else 160))
    return out


async def _one(engine, delay: float, cls: str, prompt: list[int], max_tokens: int):
    from pagedllm import SamplingParams

    await asyncio.sleep(delay)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=0 if cls == "high" else 1)
    stream = engine.add_request(prompt, params)
    async for _ in stream:
        pass
    return cls, stream.timing


async def _run(engine, requests, rate: float, seed: int) -> dict:
    arrivals = poisson_arrivals(len(requests), rate, seed + 1)
    start = time.monotonic()
    done = await asyncio.gather(*(_one(engine, a, *r) for a, r in zip(arrivals, requests)))
    seconds = time.monotonic() - start
    ttft = {"high": [], "low": []}
    for cls, timing in done:
        ttft[cls].append(timing.first_token - timing.submitted)
    return {
        "high_ttft_ms": report.percentiles_ms(ttft["high"]),
        "low_ttft_ms": report.percentiles_ms(ttft["low"]),
        "seconds": seconds,
    }


def measure(model: str | None, num: int, rate: float, max_num_seqs: int, seed: int) -> dict[str, dict]:
    from pagedllm.entrypoints.async_engine import AsyncEngine

    requests = workload(num, seed)
    rows = {}
    for name, config in CONFIGS.items():
        engine = AsyncEngine(model=model, max_num_seqs=max_num_seqs, skip_tokenizer_init=True, **config)
        try:
            rows[name] = asyncio.run(_run(engine, requests, rate, seed))
            rows[name]["preemptions"] = engine.last_stats.scheduler.num_preemptions
        finally:
            engine.shutdown()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = measure(args.model, args.requests, args.rate, args.max_num_seqs, args.seed)
    head = f"{'configuration':<26} {'high TTFT p50':>13} {'p99':>8} {'low TTFT p50':>13} {'p99':>8}"
    head += f" {'wall s':>7} {'preempt':>8}"
    print(head + "\n" + "-" * len(head))
    for name, r in rows.items():
        h, lo = r["high_ttft_ms"], r["low_ttft_ms"]
        print(
            f"{name:<26} {h['p50']:13.0f} {h['p99']:8.0f} {lo['p50']:13.0f} {lo['p99']:8.0f} "
            f"{r['seconds']:7.1f} {r['preemptions']:8d}"
        )
    print(f"(milliseconds; {args.requests} requests at {args.rate:g}/s, max_num_seqs {args.max_num_seqs})")


if __name__ == "__main__":
    main()
