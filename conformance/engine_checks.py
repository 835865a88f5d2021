"""Engine-level checks: the backend inside the real engine, against itself under different
batching, and against transformers."""

from __future__ import annotations

import functools
import random

import torch

from pagedllm.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.process import shm
from pagedllm.core.process.engine import sampled_by_request
from pagedllm.core.protocol import InitCache
from pagedllm.core.request import EngineRequest
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduling.scheduler import Scheduler
from pagedllm.fixtures.tiny_models import ARCHITECTURES, load_hf

from .op_cases import slots_of
from .results import CheckResult, compare, tolerance_text


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 120, vocab: int = 400) -> list[list[int]]:
    """n prompts of lo..hi random token ids below vocab (above the special ids 0-2)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _generate(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine(backend: str, model: str, **kw):
    from pagedllm.entrypoints.llm import LLM

    kw.setdefault("max_model_len", 512)
    kw.setdefault("num_kv_blocks", 512)
    return LLM(model, backend=backend, dtype="float32", **kw)


def first_difference(got: list[int], want: list[int]) -> str:
    """Where two token lists part, with a few tokens either side."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo = max(0, at - 2)
    return f"token {at} differs: {got[lo : at + 3]} vs expected {want[lo : at + 3]} (tokens {lo}..)"


def _mismatches(name: str, got, want, prompts) -> list[str]:
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (gs, ws) in enumerate(zip(g, w)):
            if gs != ws:
                sample = f" sample {j}" if len(g) > 1 else ""
                bad.append(
                    f"{name}: request {i}{sample} (prompt of {len(prompts[i])} tokens): {first_difference(gs, ws)}"
                )
                break
    return bad


def check_engine_behaviour(
    backend: str, model: str, quick: bool, tensor_parallel_size: int = 1, block_placement: str = "lru"
) -> list[CheckResult]:
    """The engine rows, every engine with `tensor_parallel_size` ranks and `block_placement`;
    above 1 rank, each row is also held against one rank's tokens (tensor_parallel_equivalence)."""
    prompts = random_prompts(12 if quick else 24, seed=1)
    params = [_greedy(8 + (i * 5) % 17) for i in range(len(prompts))]
    names = [
        "batching_invariance",
        "chunked_prefill_equivalence",
        "preemption_recompute",
        "preemption_swap",
        "fork_copy_on_write",
        "prefix_cache_reuse",
    ]
    if tensor_parallel_size > 1:
        names.append("tensor_parallel_equivalence")
    rows = {name: CheckResult(name) for name in names}
    shared = prompts[0] + prompts[1]
    family = [shared + p[:20] for p in prompts[2:8]]
    engine = functools.partial(
        _engine, backend, model, tensor_parallel_size=tensor_parallel_size, block_placement=block_placement
    )

    if tensor_parallel_size > 1:
        with _engine(backend, model, enable_prefix_caching=False) as llm:
            one_rank = _generate(llm, prompts, params)

    # a batch as wide as the default max_num_seqs (256; 64 in --quick) of short prompts
    wide = random_prompts(64 if quick else 256, seed=5, lo=1, hi=12)
    with engine(enable_prefix_caching=False) as llm:
        alone = [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
        batched = _generate(llm, prompts, params)
        bad = _mismatches("alone vs in a batch", batched, alone, prompts)
        wide_alone = [_generate(llm, [p], [_greedy(6)])[0] for p in wide]
        wide_batched = _generate(llm, wide, [_greedy(6)] * len(wide))
        bad += _mismatches(f"alone vs in a batch of {len(wide)}", wide_batched, wide_alone, wide)
        rows["batching_invariance"].record(not bad, failure="; ".join(bad[:3]) or None)
        # n=2 at temperature 0: both forks must continue exactly like the single sequence,
        # after the shared partial block was copied on write
        forked = _generate(llm, prompts[:6], [_greedy(sp.max_tokens, n=2) for sp in params[:6]])
        bad = [
            f"request {i}: sample {j} of 2 differs from the n=1 output: {first_difference(f[j], b[0])}"
            for i, (f, b) in enumerate(zip(forked, batched))
            for j in range(2)
            if f[j] != b[0]
        ]
        rows["fork_copy_on_write"].record(not bad, failure="; ".join(bad[:3]) or None)
        expected = _generate(llm, family, [_greedy(8)] * len(family))  # for prefix_cache_reuse
    reference = batched
    if tensor_parallel_size > 1:
        bad = _mismatches(f"{tensor_parallel_size} ranks vs one", batched, one_rank, prompts)
        rows["tensor_parallel_equivalence"].record(not bad, failure="; ".join(bad[:3]) or None)
        reference = one_rank

    with engine(enable_prefix_caching=False, max_num_batched_tokens=24) as llm:
        got = _generate(llm, prompts, params)
        bad = _mismatches("24-token chunks", got, reference, prompts)
        rows["chunked_prefill_equivalence"].record(not bad, failure="; ".join(bad[:3]) or None)

    for mode in ("recompute", "swap"):
        with engine(
            enable_prefix_caching=False,
            num_kv_blocks=20,
            max_model_len=256,
            preemption_mode=mode,
            swap_space=0.01,
        ) as llm:
            got = _generate(llm, prompts, params)
            preempted = llm.last_stats.scheduler.num_preemptions
        bad = _mismatches(f"{mode} preemption", got, reference, prompts)
        if not preempted:
            bad.append("the KV budget did not force any preemption; nothing was tested")
        rows[f"preemption_{mode}"].record(not bad, failure="; ".join(bad[:3]) or None)

    with engine(enable_prefix_caching=True) as llm:
        cold = _generate(llm, family[:1], [_greedy(8)])
        warm = _generate(llm, family, [_greedy(8)] * len(family))
        hits = llm.last_stats.scheduler.prefix_cache_hits
    bad = _mismatches("with prefix-cache hits", warm, expected, family)
    if cold[0] != expected[0]:
        bad.append("cold run with caching on differs from caching off")
    if not hits:
        bad.append("no prefix-cache hits happened; nothing was tested")
    rows["prefix_cache_reuse"].record(not bad, failure="; ".join(bad[:3]) or None)
    return list(rows.values())


def check_cache_placement(backend: str, model: str) -> CheckResult:
    """Step by step, every new K/V lands in exactly the slot the core chose — read back through
    the shared-memory pool where the backend keeps its cache there, not through the backend —
    and no other slot changes. Values are compared with the cpu reference run in lockstep."""
    from pagedllm.backends.worker import Worker

    res = CheckResult("cache_placement", tolerance_text((torch.float32,)))
    num_blocks, bs = 48, 16
    cfg = EngineConfig(model=model, backend=backend, dtype="float32")
    worker, ref = Worker(cfg), Worker(EngineConfig(model=model, backend="cpu", dtype="float32"))
    segment = None
    if worker.hello().kv_in_shared_memory:
        segment = shm.segment_name("conformance")
        spec = worker.hello().kv_spec
        shm.create_segment(segment, num_blocks * bs * spec.bytes_per_block_slot)
    try:
        init = dict(num_blocks=num_blocks, num_swap_blocks=0, block_size=bs, swap_segment=None, max_model_len=512)
        worker.init_cache(InitCache(kv_segment=segment, **init))
        ref.init_cache(InitCache(kv_segment=None, **init))
        if segment is not None:
            mapping = shm.map_segment(segment)
            pool = torch.frombuffer(mapping, dtype=torch.float32).view(worker.runner.kv_caches.shape)
            read_pool = pool.clone
        else:  # a copy: the pool may be a host tensor already, which .cpu() would hand back as is

            def read_pool():
                return worker.runner.kv_caches.to("cpu", copy=True)

        noise = torch.randn(worker.runner.kv_caches.shape, generator=torch.Generator().manual_seed(0))
        worker.runner.kv_caches.copy_(noise.to(worker.runner.kv_caches.device))
        ref.runner.kv_caches.copy_(noise)
        sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=40, max_model_len=512),
            CacheConfig(block_size=bs, num_blocks=num_blocks, enable_prefix_caching=False),
        )
        for i, p in enumerate(random_prompts(6, seed=3, lo=1, hi=70)):
            sched.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=_greedy(6)))
        _run_placement_steps(res, sched, worker, ref, read_pool, bs)
    finally:
        if segment is not None:
            shm.unlink_segment(segment)
    return res


def _run_placement_steps(res, sched, worker, ref, read_pool, bs) -> None:
    num_layers = worker.runner.kv_caches.shape[0]
    while sched.has_unfinished_requests():
        before = read_pool()
        plan = sched.schedule()
        expected = []
        for rid, n in plan.num_scheduled_tokens.items():
            end = sched.requests[rid].num_computed_tokens
            expected += slots_of(sched.kv.block_ids(rid), range(end - n, end), bs).tolist()
        result = worker.execute(plan)
        ref_result = ref.execute(plan)
        after = read_pool()
        flat_before = before.view(num_layers, 2, -1, before.shape[-2] * before.shape[-1])
        flat_after = after.view_as(flat_before)
        flat_ref = ref.runner.kv_caches.view_as(flat_before)
        changed = set((flat_after != flat_before).any(-1).any(1).any(0).nonzero().flatten().tolist())
        wanted = set(expected)
        problems = []
        if changed - wanted:
            problems.append(f"step {plan.step_id}: slots no token maps to changed: {sorted(changed - wanted)[:6]}")
        if wanted - changed:
            problems.append(
                f"step {plan.step_id}: slots the core chose were not written: {sorted(wanted - changed)[:6]}"
            )
        idx = torch.tensor(sorted(wanted))
        ok, err = compare(flat_after[:, :, idx], flat_ref[:, :, idx], torch.float32)
        if not ok:
            problems.append(f"step {plan.step_id}: K/V in the chosen slots differ from the reference by {err:.3g}")
        res.record(not problems, err, "; ".join(problems) or None)
        # both workers continue from the reference's tokens
        ref_tokens = sampled_by_request(plan, ref_result)
        own_tokens = sampled_by_request(plan, result)
        for rid, tok in ref_tokens.items():
            if own_tokens.get(rid) != tok:
                worker.state.requests[rid].token_ids[-1] = tok
        sched.update(plan, ref_tokens)


def greedy_differences(backend: str, name: str, path: str, prompts, new_tokens: int, **engine) -> list[str]:
    """Where the engine's greedy tokens part from transformers' generate, one line per prompt."""
    hf = load_hf(path)
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), **greedy)[0, len(p) :].tolist() for p in prompts]
    with _engine(backend, path, **engine) as llm:
        got = [g[0] for g in _generate(llm, prompts, [_greedy(new_tokens)] * len(prompts))]
    return [
        f"{name}: prompt of {len(p)} tokens vs transformers: {first_difference(g, w)}"
        for p, g, w in zip(prompts, got, want)
        if g != w
    ]


def check_end_to_end(backend: str, model_dirs: dict[str, str], quick: bool) -> CheckResult:
    res = CheckResult("end_to_end_vs_transformers")
    archs = ("llama", "qwen3") if quick else ARCHITECTURES
    for arch in archs:
        bad = greedy_differences(backend, arch, model_dirs[arch], random_prompts(3, seed=7, lo=1, hi=60), 12)
        res.record(not bad, failure="; ".join(bad) or None)
    return res


WINDOW = 16  # a block at the default block size: released blocks come early in short runs


def check_windowed_end_to_end(backend: str, ops, root: str, quick: bool) -> CheckResult:
    """Greedy tokens equal transformers' on a Mistral-style model windowed on every layer — the
    core releasing the blocks behind the window as requests run far past it, so a kernel that
    reads before the window reads blocks another request owns — and (full suite, where soft caps
    are declared too) on a Gemma 2 model: windows on alternate layers, soft-capped scores and
    logits. Skipped where the backend does not declare windows."""
    import os

    from pagedllm.fixtures.tiny_models import make_model_dir

    res = CheckResult("windowed_end_to_end")
    if not ops.supports("sliding_window"):
        res.skipped = "sliding windows not declared (AttentionOps.supports_sliding_window)"
        return res
    models = {"mistral, window 16": make_model_dir(os.path.join(root, "mistral-w16"), "mistral", sliding_window=WINDOW)}
    if not quick and ops.supports("soft_cap"):
        models["gemma2, soft caps"] = make_model_dir(os.path.join(root, "gemma2"), "gemma2")
    for name, path in models.items():
        prompts, new = random_prompts(3 if quick else 4, seed=11, lo=1, hi=60), 32 if quick else 40
        bad = greedy_differences(backend, name, path, prompts, new, num_kv_blocks=64, max_num_batched_tokens=64)
        res.record(not bad, failure="; ".join(bad) or None)
    return res
