"""Offline throughput: one seeded synthetic workload through pagedllm and through its peers —
transformers (static batches with padding; its own continuous batching) and, given an
environment with it, vLLM — in one run. `pagedllm bench throughput` runs this too.

    python -m pagedllm.benchmarks.bench_throughput                       # 200 long-tailed requests
    python -m pagedllm.benchmarks.bench_throughput --workload uniform --num-prompts 64

Workloads: `sharegpt` — long-tailed prompt/output lengths (see workload.py); `uniform` —
prompt and output lengths uniform in 16-256, the workload of the project's vLLM figure.
Model: the 19M-parameter random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab
32000) unless --model is given. Only the tokens each request asked for count.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from .bench_decode_step import scratch_dir
from .small_llama import small_llama_dir
from .workload import PEERS, synthetic_lengths, synthetic_prompts


def make_workload(kind: str, num: int, seed: int, vocab: int):
    if kind == "uniform":
        rng = random.Random(seed)
        lengths = [(rng.randint(16, 256), rng.randint(16, 256)) for _ in range(num)]
    else:
        lengths = synthetic_lengths(num, seed=seed, max_len=1000)
    return synthetic_prompts(lengths, vocab, seed), [o for _, o in lengths]


def run_pagedllm(
    model_dir, prompts, max_tokens, dtype, kv_cache_memory, backend="cpu", tensor_parallel_size=1, quantization=None
):
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        backend=backend,
        dtype=dtype,
        skip_tokenizer_init=True,
        kv_cache_memory=kv_cache_memory,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
    )
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


def compare(
    hf,
    model_dir,
    prompts,
    max_tokens,
    peers,
    *,
    dtype="float32",
    kv_cache_memory="2GiB",
    backend="cpu",
    batch_size=16,
    vllm_python=None,
    vllm_work=None,
    tensor_parallel_size=1,
    quantization=None,
) -> dict:
    """The workload through pagedllm, then each peer; prints the table and returns the results
    (report.SystemResult, pagedllm first, each with its greedy agreement with pagedllm)."""
    from . import report
    from .peers import hf_continuous, hf_static, vllm_subprocess

    secs, ours, startup, stats = run_pagedllm(
        model_dir, prompts, max_tokens, dtype, kv_cache_memory, backend, tensor_parallel_size, quantization
    )
    label = backend if quantization is None else f"{backend}, {quantization}"
    results = [report.account(f"pagedllm ({label})", secs, prompts, max_tokens, ours)]
    results[0].extra = {"startup_seconds": startup, "steps": stats.steps}
    overhead = (stats.step_seconds - stats.forward_seconds) / max(stats.steps, 1)
    print(f"pagedllm start-up {startup:.2f} s; {stats.steps} steps, engine overhead {overhead * 1e3:.2f} ms/step")
    versions = {}
    for peer in peers:
        if peer == "hf-static":
            s, toks = hf_static(hf, prompts, max_tokens, batch_size)
            results.append(report.account(f"transformers static batch {batch_size}", s, prompts, max_tokens, toks))
        elif peer == "hf-cb":
            s, toks = hf_continuous(hf, prompts, max_tokens)
            results.append(report.account("transformers continuous batching", s, prompts, max_tokens, toks))
        elif peer == "vllm":
            print("running vLLM in its own environment (its start-up takes a minute or so)...", flush=True)
            s, toks, vllm_startup, versions["vllm"] = vllm_subprocess(
                vllm_python, model_dir, prompts, max_tokens, dtype, vllm_work
            )
            results.append(report.account(f"vLLM {versions['vllm']} (CPU)", s, prompts, max_tokens, toks))
            results[-1].extra = {"startup_seconds": vllm_startup}
            print(
                f"start-up: pagedllm {startup:.1f} s, vLLM {vllm_startup:.1f} s ({vllm_startup / startup:.1f}x faster)"
            )
        results[-1].agreement = report.agreement(ours, toks)
    print()
    print(report.format_table(results))
    return {"results": results, "peer_versions": versions}


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
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vLLM: adds vLLM")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = args.model or small_llama_dir(scratch_dir(), args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    prompts, max_tokens = make_workload(args.workload, args.num_prompts, args.seed, hf.config.vocab_size)
    print(
        f"workload: {args.workload}, {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(max_tokens)} output tokens requested; dtype {args.dtype}"
    )
    peers = [p for p in args.vs.split(",") if p in PEERS] + (["vllm"] if args.vllm_python else [])
    compare(
        hf,
        model_dir,
        prompts,
        max_tokens,
        peers,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        batch_size=args.batch_size,
        vllm_python=args.vllm_python,
        vllm_work=os.path.join(scratch_dir(), "vllm-work"),
    )


if __name__ == "__main__":
    main()
