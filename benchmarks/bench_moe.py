"""Mixture-of-experts forward passes on the `cpu` backend against transformers, same weights,
same process, same threads: a prefill of one prompt and decode steps of 1 and 32 requests.

    python -m pagedllm.benchmarks.bench_moe [--model random:layers=4,hidden=256,experts=8,heads=8,kv_heads=2]

pagedllm's runner (paged KV, experts as one GEMM pair each over the rows routed to them)
against transformers' model (eager attention, its KV cache); medians of alternated rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from .machine import time_steps

DEFAULT_MODEL = "random:layers=4,hidden=256,experts=8,top_k=2,heads=8,kv_heads=2"


def _median_ms(fns: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # alternated: a noisy moment costs both
            times[name] += time_steps(fn, 1)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a folder, or a random: spec (pagedllm bench --help)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=256, help="decode steps' context")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)

    from transformers import DynamicCache

    from pagedllm.backends.cpu import CpuAttentionOps
    from pagedllm.backends.models.loader import load_model
    from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
    from pagedllm.core.utils import cdiv
    from pagedllm.fixtures.tiny_models import load_hf

    from .cli import random_model

    with tempfile.TemporaryDirectory() as out:
        path = random_model(args.model, out) if args.model.startswith("random:") else args.model
        hf = load_hf(path)
        model = load_model(path)
    block, batch = 16, 32
    blocks_each = cdiv(max(args.prompt, args.context + 1), block)
    runner = ModelRunner(model, CpuAttentionOps(), allocate_kv_caches(model, 1 + batch * blocks_each, block), block)
    tables = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
    history = torch.randint(3, vocab, (batch, args.context), generator=gen)
    runner.execute([SeqInput(history[i].tolist(), 0, tables[i]) for i in range(batch)])  # the decodes' context
    with torch.no_grad():
        caches = {}
        for n in (1, batch):
            caches[n] = DynamicCache(config=hf.config)
            hf(history[:n], cache=caches[n], use_cache=True)

    def ours_decode(n):
        return lambda: runner.execute([SeqInput([5], args.context, tables[i]) for i in range(n)])

    def hf_decode(n):
        def step():
            with torch.no_grad():
                hf(torch.full((n, 1), 5), cache=caches[n], use_cache=True)
                caches[n].crop(-1)  # back to the same context every round

        return step

    def hf_prefill():
        with torch.no_grad():
            hf(torch.tensor([prompt]))

    rows = [
        ("prefill", args.prompt, lambda: runner.execute([SeqInput(prompt, 0, tables[0])]), hf_prefill),
        ("decode, 1 request", 1, ours_decode(1), hf_decode(1)),
        (f"decode, {batch} requests", batch, ours_decode(batch), hf_decode(batch)),
    ]
    cfg = model.config
    print(
        f"{path}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts "
        f"(top-{cfg.num_experts_per_tok}, intermediate {cfg.expert_intermediate_size}), float32, "
        f"{torch.get_num_threads()} threads; medians of {args.rounds} alternated rounds\n"
    )
    print(f"{'pass':22} {'pagedllm ms':>12} {'transformers ms':>16} {'ratio':>7}")
    for name, _, ours, theirs in rows:
        ms = _median_ms({"ours": ours, "hf": theirs}, args.rounds)
        print(f"{name:22} {ms['ours']:>12.2f} {ms['hf']:>16.2f} {ms['hf'] / ms['ours']:>6.2f}x")


if __name__ == "__main__":
    main()
