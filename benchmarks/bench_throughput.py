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
from statistics import median

import msgspec


class PagedllmRunner:
    """One pagedllm engine kept up for every round, as the peers are: started (the start-up timed
    on its own) and warmed up once, then told to run each round's workload."""

    def __init__(self, model_dir, dtype, kv_cache_memory, backend, tensor_parallel_size, quantization, kv_cache_dtype):
        from pagedllm import LLM, SamplingParams

        t0 = time.perf_counter()
        self.llm = LLM(
            model_dir,
            backend=backend,
            dtype=dtype,
            skip_tokenizer_init=True,
            kv_cache_memory=kv_cache_memory,
            tensor_parallel_size=tensor_parallel_size,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.startup_seconds = time.perf_counter() - t0
        self._params = SamplingParams
        self.first_stats = None

    def warm_up(self, prompts):
        warm = self._params(temperature=0, max_tokens=8, ignore_eos=True)
        self.llm.generate(prompts[:2], [warm] * len(prompts[:2]), use_tqdm=False)  # as each peer gets one

    def run_round(self, prompts, max_tokens) -> tuple[float, list[list[int]]]:
        params = [self._params(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        before = self.llm.last_stats
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = self.llm.last_stats
        if self.first_stats is None:  # the first round's steps, without the warm-up's
            self.first_stats = msgspec.structs.replace(
                after,
                steps=after.steps - before.steps,
                step_seconds=after.step_seconds - before.step_seconds,
                forward_seconds=after.forward_seconds - before.forward_seconds,
            )
        return seconds, [o.outputs[0].token_ids for o in outs]

    def shutdown(self):
        self.llm.shutdown()


def round_prompts(prompts: list[list[int]], rounds: int, vocab_size: int) -> list[list[list[int]]]:
    """The workload for each round: round r's prompts start with the first token moved by r, so
    that no round finds another's prefixes cached (same lengths, same work)."""
    return [[[(p[0] + r) % vocab_size, *p[1:]] if p else p for p in prompts] for r in range(rounds)]


def same_model_check(hf, prompt: list[int], logits: list[float]) -> dict:
    """How far a peer's next-token logits for `prompt` are from transformers' (at the bench's
    dtype, full-precision weights): a comparison counts only where both compute the same model.
    Printed, and returned as {max_abs_diff, logit_std, same_argmax}."""
    import torch

    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    theirs = torch.tensor(logits)
    check = {
        "max_abs_diff": float((ref - theirs).abs().max()),
        "logit_std": float(ref.std()),
        "same_argmax": bool(ref.argmax() == theirs.argmax()),
    }
    print(
        f"llama.cpp's logits vs transformers' on the first prompt: max |diff| {check['max_abs_diff']:.3g} "
        f"(logits' std {check['logit_std']:.3g}), same argmax: {check['same_argmax']}"
    )
    return check


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
    rounds=1,
    busy=0,
) -> dict:
    """The workload through pagedllm (once per KV cache dtype, one after the other), then each
    peer, `rounds` times over, taking turns: round r runs every system before round r + 1
    starts, so a change in the machine's speed meets all of them. Every system that keeps a
    process (pagedllm, vLLM, llama.cpp) is started, timed on its own, and warmed up before the
    first round and stays up between rounds; each round starts when the CPUs are quiet (as
    quiet as `busy` busy processes leave them; machine.wait_for_quiet), so that no system runs
    beside the previous one's tail. Each system's median round counts. Prints the
    table and returns the results (report.SystemResult, pagedllm first, each with its greedy
    agreement with pagedllm on the first round and its rounds' seconds)."""
    from . import report
    from .machine import wait_for_quiet
    from .peers import LLAMA_CPP_QUANTIZED_TYPES, hf_continuous, hf_static, llama_cpp_process, vllm_process

    workloads = round_prompts(prompts, rounds, hf.config.vocab_size)
    processes, engines = {}, {}
    try:
        for kv in kv_cache_dtypes:  # before the peers start, so that each start-up is timed alone
            engines[kv] = PagedllmRunner(
                model_dir, dtype, kv_cache_memory, backend, tensor_parallel_size, quantization, kv
            )
        if "vllm" in peers:
            print("starting vLLM in its own environment (its start-up takes a minute or so)...", flush=True)
            work = os.path.join(peer_work, "vllm-work")
            processes["vllm"] = vllm_process(vllm_python, model_dir, workloads, max_tokens, dtype, work)
        if "llama.cpp" in peers:
            print("starting llama.cpp in its own environment (GGUF written first)...", flush=True)
            work = os.path.join(peer_work, "llama-cpp-work")
            processes["llama.cpp"] = llama_cpp_process(
                llama_cpp_python, model_dir, workloads, max_tokens, dtype, work, quantization=quantization
            )
        for process in processes.values():  # loaded and warmed up before any round is timed
            process.wait_ready()
        for engine in engines.values():
            engine.warm_up(workloads[0])
        seconds: dict[str, list[float]] = {}
        outputs: dict[str, list[list[int]]] = {}
        for r, work in enumerate(workloads):
            for kv, engine in engines.items():
                wait_for_quiet(busy)
                secs, toks = engine.run_round(work, max_tokens)
                seconds.setdefault(f"pagedllm {kv}", []).append(secs)
                outputs.setdefault(f"pagedllm {kv}", toks)
            for peer in peers:
                wait_for_quiet(busy)
                if peer == "hf-static":
                    secs, toks = hf_static(hf, work, max_tokens, batch_size)
                elif peer == "hf-cb":
                    secs, toks = hf_continuous(hf, work, max_tokens)
                else:
                    secs, toks = processes[peer].run_round(), None
                seconds.setdefault(peer, []).append(secs)
                outputs.setdefault(peer, toks)
            if rounds > 1:
                line = ", ".join(f"{name} {sum(max_tokens) / s[r]:.0f}" for name, s in seconds.items())
                print(f"round {r + 1}/{rounds}: out tok/s {line}", flush=True)
        finished = {peer: process.result() for peer, process in processes.items()}
        stats = {kv: (engine.startup_seconds, engine.first_stats) for kv, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
        for process in processes.values():
            process.stop()

    results, ours = [], outputs[f"pagedllm {kv_cache_dtypes[0]}"]
    for kv in kv_cache_dtypes:
        name = f"pagedllm {kv}"
        label = ", ".join([backend] + [q for q in (quantization,) if q] + ([f"KV {kv}"] if kv != "auto" else []))
        results.append(report.account(f"pagedllm ({label})", median(seconds[name]), prompts, max_tokens, outputs[name]))
        started, st = stats[kv]
        results[-1].extra = {"startup_seconds": started, "steps": st.steps, "round_seconds": seconds[name]}
        if outputs[name] is not ours:
            results[-1].agreement = report.agreement(ours, outputs[name])
        overhead = (st.step_seconds - st.forward_seconds) / max(st.steps, 1)
        print(
            f"pagedllm ({label}) start-up {started:.2f} s; {st.steps} steps, engine overhead "
            f"{overhead * 1e3:.2f} ms/step"
        )
    startup = stats[kv_cache_dtypes[0]][0]
    versions = {}
    for peer in peers:
        secs, toks, extra = median(seconds[peer]), outputs[peer], {"round_seconds": seconds[peer]}
        if peer == "hf-static":
            name = f"transformers static batch {batch_size}"
        elif peer == "hf-cb":
            name = "transformers continuous batching"
        else:
            done = finished[peer]
            toks, extra["startup_seconds"] = done["outputs"], done["startup_seconds"]
            if peer == "vllm":
                versions["vllm"] = done["vllm_version"]
                name = f"vLLM {versions['vllm']} (CPU)"
                print(
                    f"start-up: pagedllm {startup:.1f} s, vLLM {done['startup_seconds']:.1f} s "
                    f"({done['startup_seconds'] / startup:.1f}x faster)"
                )
            else:
                versions["llama.cpp"] = done["llama_cpp_version"]
                qtype = f", {LLAMA_CPP_QUANTIZED_TYPES[quantization]}" if quantization else ""
                name = f"llama.cpp {versions['llama.cpp']}{qtype} (one at a time)"
                extra["logits_vs_transformers"] = same_model_check(hf, workloads[0][0], done["first_logits"])
        results.append(report.account(name, secs, prompts, max_tokens, toks))
        results[-1].extra = extra
        results[-1].agreement = report.agreement(ours, toks)
    print()
    print(report.format_table(results))
    return {"results": results, "peer_versions": versions, "rounds": rounds}
