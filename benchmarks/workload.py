"""One seeded synthetic workload shared by the benchmarks.

Prompt and output lengths are long-tailed like ShareGPT's: log-normal, with medians of 120
prompt and 150 output tokens and a log-space spread (sigma) of 1.0 and 0.9, clipped to
[min_len, max_len]. Published ShareGPT statistics (Llama tokenizer) have mean prompt ≈ 160 and
mean output ≈ 340 with heavy tails; these defaults give means of about 200 and 220.
"""

from __future__ import annotations

import random

import numpy as np

PEERS = ("hf-static", "hf-cb", "vllm", "llama.cpp")  # the systems `bench throughput --vs` compares against


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of `num` requests as a Poisson process at `rate` per second
    (the first at 0; rate inf: all at once)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num):
        arrivals.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    return arrivals


def uniform_lengths(num_requests: int, seed: int = 0, lo: int = 16, hi: int = 256) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs, each uniform in lo..hi (the workload of the
    project's first vLLM figure)."""
    rng = random.Random(seed)
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(num_requests)]


def synthetic_lengths(
    num_requests: int,
    seed: int = 0,
    prompt_median: float = 120.0,
    output_median: float = 150.0,
    prompt_sigma: float = 1.0,
    output_sigma: float = 0.9,
    min_len: int = 4,
    max_len: int = 1024,
) -> list[tuple[int, int]]:
    """[(prompt_len, output_len)] for `num_requests` requests."""
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(np.log(prompt_median), prompt_sigma, num_requests)
    outputs = rng.lognormal(np.log(output_median), output_sigma, num_requests)
    clip = lambda x: np.clip(np.rint(x), min_len, max_len).astype(int)
    return list(zip(clip(prompts).tolist(), clip(outputs).tolist()))


def synthetic_prompts(lengths: list[tuple[int, int]], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids for each prompt length (ids 10.. avoid special tokens)."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(10, vocab_size, n).tolist() for n, _ in lengths]
