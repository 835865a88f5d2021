"""Tensor parallelism: decode-step time and each rank's weight and KV memory at 1 and 2 ranks,
on a random Llama big enough for the split to matter (159M parameters: hidden 1024, 8 layers,
16 heads, 8 KV heads, intermediate 2816, vocab 32000; float32).

    python -m pagedllm.benchmarks.bench_tp [--ranks 1,2] [--requests 32] [--steps 48]

Weights per rank are the parameter bytes that rank's slice of the checkpoint loads into; KV per
rank is the size of its shared-memory pool for the same number of blocks. The decode step is
the workers' forward-and-sample time per step, from the engine's stats, with every request
decoding. On a 2-core machine two ranks share the same cores, so speed cannot improve here;
the memory split is what this measures.
"""

from __future__ import annotations

import argparse
import os

from .bench_decode_step import scratch_dir

NUM_BLOCKS = 1024


def big_llama_dir(root: str) -> str:
    import torch
    import transformers as tf

    from pagedllm.fixtures.tiny_models import make_tokenizer

    path = os.path.join(root, "llama-159m")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    make_tokenizer(400).save_pretrained(path)
    return path


def weight_bytes(path: str, rank: int, size: int) -> int:
    from pagedllm.backends.models.loader import load_model
    from pagedllm.backends.models.parallel import TensorParallel

    model = load_model(path, tp=TensorParallel(rank, size))
    params = {id(p): p for p in model.parameters()}  # tied weights once
    return sum(p.numel() * p.element_size() for p in params.values())


def decode_step_ms(path: str, size: int, requests: int, steps: int) -> tuple[float, list[int]]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.process import shm

    with LLM(
        path, tensor_parallel_size=size, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, skip_tokenizer_init=True
    ) as llm:
        kv_bytes = [
            os.path.getsize(os.path.join(shm.SHM_DIR, name))
            for name in shm.segments_of(llm.engine.pid)
            if "-kv-" in name
        ]
        prompts = [[(7 * i + j) % 31000 + 10 for j in range(64)] for i in range(requests)]
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # prefill, warm
        before = llm.last_stats
        llm.generate(
            [p + [11] for p in prompts],
            SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
            use_tqdm=False,
        )  # the prompts hit the cache: nearly every step decodes
        after = llm.last_stats
    forward = (after.forward_seconds - before.forward_seconds) / (after.steps - before.steps)
    return forward * 1e3, kv_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args(argv)
    path = big_llama_dir(scratch_dir())
    rows = []
    for size in (int(r) for r in args.ranks.split(",")):
        weights = [weight_bytes(path, r, size) for r in range(size)]
        step_ms, kv = decode_step_ms(path, size, args.requests, args.steps)
        rows.append((size, weights, kv, step_ms))
    print(f"{args.requests} requests decoding, 64-token prompts, {NUM_BLOCKS} KV blocks of 16, float32")
    print(f"{'ranks':>5} {'weights per rank (MiB)':>24} {'KV pool per rank (MiB)':>24} {'decode step (ms)':>17}")
    base = rows[0]
    for size, weights, kv, step_ms in rows:
        w = "/".join(f"{b / 2**20:.0f}" for b in weights)
        k = "/".join(f"{b / 2**20:.0f}" for b in kv)
        print(f"{size:>5} {w:>24} {k:>24} {step_ms:>12.1f} ({step_ms / base[3]:.2f}x)")
    for size, weights, kv, _ in rows[1:]:
        print(
            f"{size} ranks: weights per rank {max(weights) / sum(base[1]):.2f} of one rank's, "
            f"KV per rank {max(kv) / sum(base[2]):.2f}"
        )


if __name__ == "__main__":
    main()
