"""Offline throughput: one seeded synthetic workload through pagedllm and through
transformers (static batches with padding, and its own continuous batching), in one run.

    python -m pagedllm.benchmarks.bench_throughput                       # 200 long-tailed requests
    python -m pagedllm.benchmarks.bench_throughput --workload uniform --num-prompts 64

Workloads: `sharegpt` — long-tailed prompt/output lengths (see workload.py); `uniform` —
prompt and output lengths uniform in 16-256, the workload of the project's vLLM figure.
Model: the 19M-parameter random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab
32000) unless --model is given. Only the tokens each request asked for count.
"""

from __future__ import annotations

import argparse
import random
import time

from .bench_decode_step import scratch_dir, small_llama_dir
from .workload import synthetic_lengths, synthetic_prompts


def make_workload(kind: str, num: int, seed: int, vocab: int):
    if kind == "uniform":
        rng = random.Random(seed)
        lengths = [(rng.randint(16, 256), rng.randint(16, 256)) for _ in range(num)]
    else:
        lengths = synthetic_lengths(num, seed=seed, max_len=1000)
    return synthetic_prompts(lengths, vocab, seed), [o for _, o in lengths]


def run_pagedllm(model_dir, prompts, max_tokens, dtype, kv_cache_memory, backend="cpu"):
    from pagedllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model_dir, backend=backend, dtype=dtype, skip_tokenizer_init=True, kv_cache_memory=kv_cache_memory)
    startup = time.perf_counter() - t0
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = llm.last_stats
    finally:
        llm.shutdown()
    return seconds, [o.outputs[0].token_ids for o in outs], startup, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["sharegpt", "uniform"], default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    ap.add_argument("--vs", default="hf-static,hf-cb", help="peers to run: hf-static, hf-cb (or none)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from .peers import hf_continuous, hf_static
    from .report import account, agreement, format_table

    model_dir = args.model or small_llama_dir(scratch_dir(), args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    prompts, max_tokens = make_workload(args.workload, args.num_prompts, args.seed, hf.config.vocab_size)
    print(f"workload: {args.workload}, {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(max_tokens)} output tokens requested; dtype {args.dtype}")

    secs, ours, startup, stats = run_pagedllm(model_dir, prompts, max_tokens, args.dtype, args.kv_cache_memory)
    results = [account("pagedllm (cpu backend)", secs, prompts, max_tokens, ours)]
    print(f"pagedllm start-up {startup:.2f} s; {stats.steps} steps, engine overhead "
          f"{(stats.step_seconds - stats.forward_seconds) / max(stats.steps, 1) * 1e3:.2f} ms/step")
    peers = [p for p in args.vs.split(",") if p and p != "none"]
    if "hf-static" in peers:
        secs, toks = hf_static(hf, prompts, max_tokens, args.batch_size)
        results.append(account(f"transformers generate, static batch {args.batch_size}", secs, prompts,
                               max_tokens, toks))
        results[-1].agreement = agreement(ours, toks)
    if "hf-cb" in peers:
        secs, toks = hf_continuous(hf, prompts, max_tokens)
        results.append(account("transformers continuous batching", secs, prompts, max_tokens, toks))
        results[-1].agreement = agreement(ours, toks)
    print()
    print(format_table(results))

if __name__ == "__main__":
    main()
