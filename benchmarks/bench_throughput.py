"""Offline throughput: one workload through pagedllm and through its peers — transformers
(static batches with padding; its own continuous batching) and, given an environment with it,
vLLM — in one run. Its front door is `pagedllm bench throughput` (benchmarks/cli.py), e.g.

    pagedllm bench throughput --dataset uniform --num-prompts 64 --vs none
    pagedllm bench throughput --model DIR --vs hf-static --vllm-python ~/vllm-env/bin/python

Only the tokens each request asked for count.
"""

from __future__ import annotations

import os
import time

import msgspec


def run_pagedllm(
    model_dir,
    prompts,
    max_tokens,
    dtype,
    kv_cache_memory,
    backend="cpu",
    tensor_parallel_size=1,
    quantization=None,
    kv_cache_dtype="auto",
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
        kv_cache_dtype=kv_cache_dtype,
    )
    startup = time.perf_counter() - t0
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate(prompts[:2], [warm] * len(prompts[:2]), use_tqdm=False)  # warm-up, as each peer gets one
        before = llm.last_stats
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = llm.last_stats
        stats = msgspec.structs.replace(  # this run's steps, without the warm-up's
            after,
            steps=after.steps - before.steps,
            step_seconds=after.step_seconds - before.step_seconds,
            forward_seconds=after.forward_seconds - before.forward_seconds,
        )
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
    llama_cpp_python=None,
    peer_work="bench-results",
    tensor_parallel_size=1,
    quantization=None,
    kv_cache_dtypes=("auto",),
) -> dict:
    """The workload through pagedllm (once per KV cache dtype, one after the other), then each
    peer; prints the table and returns the results (report.SystemResult, pagedllm first, each
    with its greedy agreement with pagedllm)."""
    from . import report
    from .peers import hf_continuous, hf_static, llama_cpp_subprocess, vllm_subprocess

    results, ours, startup = [], None, None
    for kv in kv_cache_dtypes:
        secs, toks, started, stats = run_pagedllm(
            model_dir, prompts, max_tokens, dtype, kv_cache_memory, backend, tensor_parallel_size, quantization, kv
        )
        label = ", ".join([backend] + [q for q in (quantization,) if q] + ([f"KV {kv}"] if kv != "auto" else []))
        results.append(report.account(f"pagedllm ({label})", secs, prompts, max_tokens, toks))
        results[-1].extra = {"startup_seconds": started, "steps": stats.steps}
        if ours is None:
            ours, startup = toks, started
        else:
            results[-1].agreement = report.agreement(ours, toks)
        overhead = (stats.step_seconds - stats.forward_seconds) / max(stats.steps, 1)
        print(
            f"pagedllm ({label}) start-up {started:.2f} s; {stats.steps} steps, engine overhead "
            f"{overhead * 1e3:.2f} ms/step"
        )
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
                vllm_python, model_dir, prompts, max_tokens, dtype, os.path.join(peer_work, "vllm-work")
            )
            results.append(report.account(f"vLLM {versions['vllm']} (CPU)", s, prompts, max_tokens, toks))
            results[-1].extra = {"startup_seconds": vllm_startup}
            print(
                f"start-up: pagedllm {startup:.1f} s, vLLM {vllm_startup:.1f} s ({vllm_startup / startup:.1f}x faster)"
            )
        elif peer == "llama.cpp":
            print("running llama.cpp in its own environment (GGUF written first), one request at a time...", flush=True)
            s, toks, llama_startup, versions["llama.cpp"] = llama_cpp_subprocess(
                llama_cpp_python, model_dir, prompts, max_tokens, dtype, os.path.join(peer_work, "llama-cpp-work")
            )
            name = f"llama.cpp (llama-cpp-python {versions['llama.cpp']}, one at a time)"
            results.append(report.account(name, s, prompts, max_tokens, toks))
            results[-1].extra = {"startup_seconds": llama_startup}
        results[-1].agreement = report.agreement(ours, toks)
    print()
    print(report.format_table(results))
    return {"results": results, "peer_versions": versions}
