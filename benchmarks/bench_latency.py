"""Latency under load: requests arrive as a Poisson process at each rate, through the asyncio
frontend (`AsyncEngine`, in process), and time to first token and the gaps between tokens are
measured where the caller receives them. `pagedllm bench latency` runs this."""

from __future__ import annotations

import asyncio
import time

from . import report
from .workload import poisson_arrivals


async def _one(engine, delay: float, prompt: list[int], max_tokens: int):
    from pagedllm import SamplingParams

    await asyncio.sleep(delay)
    stream = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens = 0
    async for out in stream:
        tokens += len(out.delta_token_ids)
    return stream.timing, tokens


async def _at_rate(engine, prompts, max_tokens, rate: float, seed: int) -> dict:
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    start = time.monotonic()
    done = await asyncio.gather(*(_one(engine, a, p, m) for a, p, m in zip(arrivals, prompts, max_tokens)))
    seconds = time.monotonic() - start
    ttft = [timing.first_token - timing.submitted for timing, _ in done if timing.first_token is not None]
    itl = [gap for timing, _ in done for gap in timing.token_gaps]
    return {
        "rate": rate,
        "ttft_ms": report.percentiles_ms(ttft),
        "itl_ms": report.percentiles_ms(itl),
        "output_tok_s": sum(n for _, n in done) / seconds,
    }


def measure(model_dir: str, prompts, max_tokens, rates, seed: int = 0, **engine_args) -> list[dict]:
    from pagedllm.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(model=model_dir, skip_tokenizer_init=True, **engine_args)
    try:
        return [asyncio.run(_at_rate(engine, prompts, max_tokens, rate, seed)) for rate in rates]
    finally:
        engine.shutdown()


def print_rows(rows: list[dict]) -> None:
    head = f"{'req/s':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>9} {'p90':>8} {'p99':>8} {'out tok/s':>10}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"{r['rate']:7.1f} {t['p50']:9.1f} {t['p90']:8.1f} {t['p99']:8.1f} {i['p50']:9.1f} {i['p90']:8.1f} "
            f"{i['p99']:8.1f} {r['output_tok_s']:10.0f}"
        )
    print("(milliseconds)")
