"""What logit_bias costs the sampler: 64 requests, each with a 300-entry bias (OpenAI's
typical use: banning or boosting a word list), against the same batch without, greedy and
sampled; and the demo model's 64-request decode step, to give the cost as a share of a step.
Rounds alternate the cases so that the machine's drift falls on all of them.

Run: python -m pagedllm.benchmarks.bench_logit_bias [--rounds 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.backends.sampler import Sampler, SamplingRow
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.entrypoints.default_model import shipped_model_dir

from .machine import describe, finish, machine_record, time_steps


def sampler_rows(batch: int, vocab: int, entries: int, temperature: float, seed: int = 0) -> list[SamplingRow]:
    """`batch` rows of 64 tokens of history, each with its own `entries`-token bias (0: none)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        bias = {t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), entries)} if entries else None
        params = SamplingParams(temperature=temperature, max_tokens=256, logit_bias=bias)
        rows.append(SamplingRow(params, [rng.randrange(vocab) for _ in range(64)], 32))
    return rows


def decode_step(batch: int, context: int = 128):
    """A replayable decode step of the demo model for `batch` requests at `context` tokens."""
    model = load_model(shipped_model_dir())
    block = 16
    per = context // block + 1
    kv = allocate_kv_caches(model, batch * per + 1, block)
    ops = CpuAttentionOps()
    runner = ModelRunner(model, ops, kv, block)
    runner.replay = ops.capture_graphs(model, kv, block, batch, 512)
    seqs = [SeqInput([7], context, list(range(1 + i * per, 1 + (i + 1) * per))) for i in range(batch)]
    return lambda: runner.execute(seqs), model.config.vocab_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--entries", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    record = machine_record()
    step, vocab = decode_step(args.batch)
    logits = torch.randn(args.batch, vocab)
    sampler = Sampler()
    cases = {
        (kind, temperature): sampler_rows(args.batch, vocab, args.entries if kind == "bias" else 0, temperature)
        for kind in ("none", "bias")
        for temperature in (0.0, 1.0)
    }
    times = {case: [] for case in cases}
    step_times = []
    for _ in range(args.rounds):
        step_times += time_steps(step, args.steps // 4)
        for case, rows in cases.items():
            times[case] += time_steps(lambda rows=rows: sampler(logits, rows), args.steps)
    step_ms = statistics.median(step_times) * 1e3
    print(f"decode step, demo model, {args.batch} requests at 128 tokens: {step_ms:.3f} ms (median)")
    print(f"| sampling | no bias (ms) | {args.entries}-entry bias each (ms) | added | share of a decode step |")
    print("|---|---|---|---|---|")
    for temperature, name in ((0.0, "greedy"), (1.0, "temperature 1")):
        none = statistics.median(times[("none", temperature)]) * 1e3
        bias = statistics.median(times[("bias", temperature)]) * 1e3
        print(f"| {name} | {none:.3f} | {bias:.3f} | {bias - none:+.3f} ms | {(bias - none) / step_ms:.1%} |")
    print(describe(finish(record)))


if __name__ == "__main__":
    main()
