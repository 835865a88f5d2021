"""The invariance tier: a probe request's token ids, logprobs and prompt logprobs, bit for bit,
on an idle engine against the same request under each thing that may change a reduction's
order — a batch around it (and its order reversed), its prefill chunked, a prefix-cache hit,
a copy-on-write fork, preemption by recompute and by swap, speculative verification, one
compute thread — for a dense and a mixture-of-experts model, 16- and 32-bit, 8- and 4-bit
weights and 8-bit KV caches.

A backend that declares `batch_invariant` must pass every row. For one that does not, the rows
are information: each shows the largest logprob difference it found (tokens that part are
shown as an infinite difference, with where).
"""

from __future__ import annotations

import copy
import math
import random

import msgspec

from pagedllm.core.sampling_params import SamplingParams

from .engine_checks import random_prompts
from .results import CheckResult

# many distinct tokens, then a passage again: n-gram speculation finds proposals to verify
PASSAGE = random.Random(0).sample(range(3, 390), 100)
PROBE = PASSAGE + PASSAGE[:20]
PROBE_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
# a request asking for prompt logprobs computes its whole prompt (no prefix-cache hit), so the
# prefix-hit row's probe asks for none
CASE_PARAMS = {"prefix_hit": msgspec.structs.replace(PROBE_PARAMS, prompt_logprobs=None)}
# the engine's shape, the same for every run of a row (a block size may change a request's numbers)
SHAPE = {"block_size": 16, "max_model_len": 256}


def _difference(got, want) -> tuple[float, str | None]:
    """(largest logprob difference, why they are not the same bits or None)."""
    if [c.token_ids for c in got.outputs] != [c.token_ids for c in want.outputs]:
        g, w = got.outputs[0].token_ids, want.outputs[0].token_ids
        at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        return math.inf, f"tokens part at {at}: {list(g[at : at + 3])} vs alone {list(w[at : at + 3])}"
    worst = 0.0
    for entries_got, entries_want in [(c.logprobs, d.logprobs) for c, d in zip(got.outputs, want.outputs)] + [
        (got.prompt_logprobs, want.prompt_logprobs)
    ]:
        for a, b in zip(entries_got or [], entries_want or []):
            for token in set(a or {}) & set(b or {}):
                worst = max(worst, abs(a[token].logprob - b[token].logprob))
            if set(a or {}) != set(b or {}):
                worst = math.inf
    same = all(repr(c.logprobs) == repr(d.logprobs) for c, d in zip(got.outputs, want.outputs)) and repr(
        got.prompt_logprobs
    ) == repr(want.prompt_logprobs)
    return worst, None if same else f"logprobs differ by up to {worst:.3g}"


def _case_runs(llm, case: str, probe_params: SamplingParams):
    """The probe's output(s) under one case, on an engine configured for it."""
    params = probe_params
    if case == "fork":  # n = 2 greedy: the forks share the prompt's blocks, then copy on write
        (out,) = llm.generate([PROBE], _with(params, n=2), use_tqdm=False)
        return [_single(out, 0), _single(out, 1)]
    if case == "prefix_hit":
        llm.generate([PROBE[:70] + [7, 8, 9]], _with(params, max_tokens=1), use_tqdm=False)
        return [llm.generate([PROBE], params, use_tqdm=False)[0]]
    if case in ("batch", "batch_order", "preemption_recompute", "preemption_swap"):
        others = random_prompts(24, seed=1, lo=4, hi=89)  # steps of more than 16 rows, where kernels may change
        batch = others[:5] + [PROBE] + others[5:]
        if case == "batch_order":
            batch = batch[::-1]
        plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(batch, [params if p is PROBE else plain for p in batch], use_tqdm=False)
        return [outs[batch.index(PROBE)]]
    return [llm.generate([PROBE], params, use_tqdm=False)[0]]  # chunked, speculation, threads


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return msgspec.structs.replace(params, **changes)


def _single(out, index: int):
    """A copy of a request output holding only its completion `index`."""
    one = copy.copy(out)
    one.outputs = [out.outputs[index]]
    return one


# row -> the options its busy engine runs with (over the reference's)
CASES = {
    "batch": {},
    "batch_order": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "prefix_hit": {"enable_prefix_caching": True},
    "fork": {},
    "preemption_recompute": {"num_kv_blocks": 14, "max_model_len": 160, "max_num_seqs": 16},
    "preemption_swap": {
        "num_kv_blocks": 14,
        "max_model_len": 160,
        "max_num_seqs": 16,
        "preemption_mode": "swap",
        "swap_space": 0.01,
    },
    "speculative_verification": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "one_thread": {"cpu_threads": 1},
}
# what must have happened in a row's run for it to have tested anything
EXERCISED = {
    "prefix_hit": (lambda s: s.prefix_cache_hits, "no prefix-cache hit"),
    "preemption_recompute": (lambda s: s.num_preemptions, "the pool forced no preemption"),
    "preemption_swap": (lambda s: s.num_preemptions, "the pool forced no preemption"),
    "speculative_verification": (lambda s: s.spec_decode and s.spec_decode.num_drafts, "no proposal was verified"),
}
QUICK_CASES = ("batch", "speculative_verification")
# variants of the model and cache: (row suffix, model arch, engine options), each run on the batch
# row, quantized weights on the chunked-prefill row too (their kernel depends on a step's row
# count); a suffix never ends in a dtype's name (the support matrix reads those as kernel rows).
# Quantized weights run with --batch-invariant, and once without it.
VARIANTS = (
    ("bfloat16 model", "llama", {"dtype": "bfloat16"}),
    ("MoE model", "qwen3-moe", {}),
    ("MoE bfloat16 model", "qwen3-moe", {"dtype": "bfloat16"}),
    ("int8 weights, --batch-invariant", "llama", {"quantization": "int8", "batch_invariant": True}),
    ("int4 weights, --batch-invariant", "llama", {"quantization": "int4", "batch_invariant": True}),
    ("int8 weights", "llama", {"quantization": "int8"}),
    ("int8 KV cache", "llama", {"kv_cache_dtype": "int8"}),
    ("fp8_e4m3 KV cache", "llama", {"kv_cache_dtype": "fp8_e4m3"}),
)
QUANTIZED_VARIANT_CASES = ("batch", "chunked_prefill")


def _supported_variants(ops) -> list[tuple[str, str, dict]]:
    import torch

    out = []
    for name, arch, options in VARIANTS:
        if options.get("dtype") == "bfloat16" and torch.bfloat16 not in ops.supported_dtypes:
            continue
        kv = options.get("kv_cache_dtype")
        if kv is not None and ops.unsupported_kv_cache_dtype(kv, head_size=16):
            continue
        out.append((name, arch, options))
    return out


def check_invariance(
    backend: str, ops, model_dir, quick: bool, cases=None, variants: bool = True, tensor_parallel_size: int = 1
) -> list[CheckResult]:
    """The invariance rows. `ops`: the backend's ops (what it declares); model_dir(arch): a
    fixture model's folder; cases: these rows of CASES only (default: all, QUICK_CASES when
    quick); variants: also the batch row on each model and cache variant (not when quick).
    Every engine runs with `tensor_parallel_size` ranks: the rows hold within one size (a size
    changes the order of the reductions the ranks split, so not across sizes)."""
    from pagedllm.entrypoints.llm import LLM

    def promised(options: dict) -> bool:
        """What the backend promises for an engine with these options (its answer for a
        quantized model may depend on --batch-invariant)."""
        if not getattr(ops, "batch_invariant", False):
            return False
        if not hasattr(ops, "batch_invariant_for"):  # written for a contract before v6
            return True
        saved = ops.batch_invariant_mode
        ops.batch_invariant_mode = bool(options.get("batch_invariant"))
        try:
            return bool(ops.batch_invariant_for(quantized=options.get("quantization") is not None))
        finally:
            ops.batch_invariant_mode = saved

    def engine(arch: str, **options):
        base = {"dtype": "float32", "num_kv_blocks": 256, "enable_prefix_caching": False, **SHAPE}
        base["tensor_parallel_size"] = tensor_parallel_size
        return LLM(model_dir(arch), backend=backend, skip_tokenizer_init=True, **{**base, **options})

    def row(name: str, got: list, want, options: dict) -> CheckResult:
        declared = promised(options)
        tolerance = "same bits (declared)" if declared else "information (not declared invariant)"
        result = CheckResult(f"invariance {name}", tolerance=tolerance, informational=not declared)
        for out in got:
            worst, why = _difference(out, want)
            result.record(why is None, 0.0 if why is None else worst, why)
        return result

    def measured(llm, case: str, alone) -> CheckResult:
        got = _case_runs(llm, case, CASE_PARAMS.get(case, PROBE_PARAMS))
        happened, missing = EXERCISED.get(case, (lambda s: True, ""))
        if not happened(llm.last_stats.scheduler):
            result = CheckResult(f"invariance {case}")
            result.record(False, math.inf, f"{missing}: nothing was tested")
            return result
        return row(case, got, alone, {})

    cases = cases or (QUICK_CASES if quick else tuple(CASES))
    measured_rows = {}
    with engine("llama") as reference:
        alone = {
            case: reference.generate([PROBE], CASE_PARAMS.get(case, PROBE_PARAMS), use_tqdm=False)[0] for case in cases
        }
        # a case that needs no option of its own runs here, once every probe has run alone
        for case in [c for c in cases if not CASES[c]]:
            measured_rows[case] = measured(reference, case, alone[case])
    for case in [c for c in cases if CASES[c]]:
        with engine("llama", **CASES[case]) as llm:
            measured_rows[case] = measured(llm, case, alone[case])
    rows = [measured_rows[case] for case in cases]
    for name, arch, options in _supported_variants(ops) if variants and not quick else []:
        with engine(arch, **options) as llm:
            want = llm.generate([PROBE], PROBE_PARAMS, use_tqdm=False)[0]
            got = {"batch": _case_runs(llm, "batch", PROBE_PARAMS)}
        if "quantization" in options:
            with engine(arch, **options, **CASES["chunked_prefill"]) as llm:
                got["chunked_prefill"] = _case_runs(llm, "chunked_prefill", PROBE_PARAMS)
        rows += [row(f"{case}, {name}", outs, want, options) for case, outs in got.items()]
    return rows
