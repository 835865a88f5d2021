"""The engine's own cost per step — schedule, messages both ways, the worker's bookkeeping,
update — with 256 running requests, next to the worker's forward pass.

    python -m pagedllm.benchmarks.bench_engine_overhead [--requests 256] [--max-tokens 64]

A tiny model keeps the forward pass short; overhead = core wall time per step minus the
worker's forward-and-sample time. Start-up (LLM() to ready) is reported too.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from pagedllm import LLM, SamplingParams
    from pagedllm.fixtures.tiny_models import make_model_dir

    from .bench_decode_step import scratch_dir

    model = make_model_dir(scratch_dir() + "/m", "llama")
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=args.requests, skip_tokenizer_init=True, kv_cache_memory="256MiB")
    startup = time.perf_counter() - t0
    try:
        prompts = [[10 + (i % 300)] * args.prompt_len for i in range(args.requests)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        before = llm.last_stats
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False
        )
        after = llm.last_stats
    finally:
        llm.shutdown()
    steps = after.steps - before.steps
    wall = (after.step_seconds - before.step_seconds) / steps
    forward = (after.forward_seconds - before.forward_seconds) / steps
    print(f"start-up (LLM() to ready): {startup:.2f} s")
    print(
        f"{args.requests} running requests, {steps} steps: {wall * 1e3:.2f} ms per step, of which "
        f"forward+sampling {forward * 1e3:.2f} ms; engine overhead {(wall - forward) * 1e3:.2f} ms per step "
        f"({after.planned_ahead - before.planned_ahead} steps planned ahead)"
    )


if __name__ == "__main__":
    main()
