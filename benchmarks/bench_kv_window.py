"""KV cache one request holds at an 8k context, with and without sliding windows, measured.

    python -m pagedllm.benchmarks.bench_kv_window [--context 8192] [--window 512]

Three random models with the same attention shape per layer (6 layers, 1 KV head of 256, as
Gemma 3 1B's layers have) run one request to `--context` tokens, prefix caching off, its
prompt prefilled in steps of `--step-tokens`, in the real engine; the scheduler's peak of
blocks in use is the KV the request held (a step's own tokens included):

- full attention on every layer (Llama);
- the window on every layer (Mistral-style): blocks behind it are released as it slides;
- Gemma 3's interleave, five windowed layers to one global. One block table serves every
  layer, so the windowed layers keep their whole context too; the last column is what
  per-group tables (vLLM's hybrid allocator, docs/architecture.md) would hold: the global
  layers' whole context and the windowed layers' window and one block, computed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from pagedllm.core.utils import cdiv
from pagedllm.fixtures.tiny_models import make_model_dir

LAYERS, KV_HEADS, HEAD = 6, 1, 256
SHAPE = dict(num_hidden_layers=LAYERS, num_key_value_heads=KV_HEADS, head_dim=HEAD)


def models(root: str, window: int, context: int) -> dict[str, tuple[str, int]]:
    """name -> (folder, layers whose window applies)."""
    positions = dict(max_position_embeddings=context + 64)
    return {
        "full attention (Llama)": (make_model_dir(os.path.join(root, "full"), "llama", **SHAPE, **positions), 0),
        "window on every layer (Mistral)": (
            make_model_dir(os.path.join(root, "mistral"), "mistral", sliding_window=window, **SHAPE, **positions),
            LAYERS,
        ),
        "5 windowed : 1 global (Gemma 3)": (
            make_model_dir(os.path.join(root, "gemma3"), "gemma3", sliding_window=window, **SHAPE, **positions),
            5,
        ),
    }


def held_blocks(path: str, context: int, block_size: int, step_tokens: int) -> int:
    from pagedllm import LLM, SamplingParams

    prompt = [random.Random(0).randrange(3, 400) for _ in range(context - 64)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    engine = dict(block_size=block_size, enable_prefix_caching=False, max_model_len=context + 64)
    engine["max_num_batched_tokens"] = step_tokens
    with LLM(path, num_kv_blocks=cdiv(context, block_size) + 16, skip_tokenizer_init=True, **engine) as llm:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return llm.last_stats.scheduler.peak_blocks_used


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens: the prefill's chunks")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    per_layer_token = 2 * KV_HEADS * HEAD * 2  # K and V, bfloat16 bytes (the float32 run is twice this)
    block_bytes = LAYERS * per_layer_token * args.block_size
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, (path, windowed) in models(root, args.window, args.context).items():
            blocks = held_blocks(path, args.context, args.block_size, args.step_tokens)
            window_blocks = cdiv(args.window, args.block_size) + 1
            grouped = (LAYERS - windowed) * cdiv(args.context, args.block_size) + windowed * window_blocks
            rows.append(
                {
                    "model": name,
                    "blocks_held": blocks,
                    "kv_mib": blocks * block_bytes / 2**20,
                    "per_group_tables_mib": grouped * args.block_size * per_layer_token / 2**20,
                }
            )
    print(f"one request at {args.context} tokens, window {args.window}, {LAYERS} layers x {KV_HEADS} KV head x {HEAD}")
    print(f"(bfloat16 KV; block size {args.block_size}; prefill steps of {args.step_tokens} tokens)\n")
    print(f"{'model':34} {'blocks held':>12} {'KV held':>10} {'per-group tables':>17}")
    for r in rows:
        print(f"{r['model']:34} {r['blocks_held']:>12} {r['kv_mib']:>7.1f} MiB {r['per_group_tables_mib']:>13.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            run = {"context": args.context, "window": args.window, "step_tokens": args.step_tokens, "rows": rows}
            json.dump(run, f, indent=2)


if __name__ == "__main__":
    main()
