"""The whole engine through its real processes and sockets, against transformers."""

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.fixtures.tiny_models import load_hf

from model_helpers import hf_greedy
from proc_helpers import engine_processes, segments_of


def workload(seed: int = 0, vocab: int = 400):
    """32 prompts, lengths 1-300, some sharing long prefixes; max_tokens 1-64."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(120)]
    lengths = [1, 300, 2, 17, 16, 15, 64, 250] + [rng.randrange(1, 301) for _ in range(24)]
    prompts = []
    for i, n in enumerate(lengths):
        if i in (1, 7) or (i % 4 == 3 and n > 130):  # some share a 120-token prefix
            prompts.append(shared + [rng.randrange(3, vocab) for _ in range(n - 120)])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(n)])
    max_tokens = [1, 64, 64, 2] + [rng.randrange(1, 65) for _ in range(28)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(tiny_model):
    path = tiny_model("llama")
    hf = load_hf(path)
    prompts, max_tokens = workload()
    return path, prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_32_requests_under_kv_pressure_match_transformers(reference, prefix_caching, mode):
    path, prompts, max_tokens, expected = reference
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    with LLM(
        path,
        num_kv_blocks=48,
        max_model_len=512,
        max_num_batched_tokens=128,
        enable_prefix_caching=prefix_caching,
        preemption_mode=mode,
        swap_space=0.01,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.last_stats
        engine = llm.engine
    assert stats.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    if prefix_caching:
        assert stats.scheduler.prefix_cache_hits > 0
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.outputs[0].token_ids == want, f"request {i}: prompt of {len(prompts[i])} tokens"
        assert out.outputs[0].finish_reason == "length"
    assert not engine_processes(engine) and not segments_of(engine.pid)


def test_async_scheduling_gives_transformers_tokens_with_stops_and_late_arrivals(reference):
    """Decode steps planned while the previous one computes: the same greedy tokens as
    transformers (and as planning after each result), requests stopping on a stop token in
    the middle of the batch, and a second generate call joining a running engine."""
    path, prompts, max_tokens, expected = reference
    stops = [want[len(want) // 2] if len(want) > 4 else None for want in expected]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop_token_ids=[s] if s is not None else None)
        for m, s in zip(max_tokens, stops)
    ]
    wanted = [want[: want.index(s) + 1] if s is not None else want for want, s in zip(expected, stops)]
    for async_scheduling in (True, False):
        with LLM(path, num_kv_blocks=512, max_model_len=512, async_scheduling=async_scheduling) as llm:
            first = llm.generate(prompts[:16], params[:16], use_tqdm=False)
            second = llm.generate(prompts[16:], params[16:], use_tqdm=False)
            stats = llm.last_stats
        for i, out in enumerate(first + second):
            assert out.outputs[0].token_ids == wanted[i], f"request {i}, async_scheduling={async_scheduling}"
            assert out.outputs[0].finish_reason == ("stop" if stops[i] is not None else "length")
        if async_scheduling:
            assert stats.planned_ahead > stats.steps // 2, f"{stats.planned_ahead} of {stats.steps} steps planned ahead"
        else:
            assert stats.planned_ahead == 0


def test_decode_runs_change_no_token_logprob_or_finish(tiny_model):
    """Decode runs (steps the worker takes without a plan of its own) against an engine that
    plans every step, each started on its own: seeded sampling, penalties, logit bias,
    logprobs, a stop string, a stop token past min_tokens, n > 1 and length limits inside a
    run give the same tokens, logprobs and finish reasons."""
    path = tiny_model("llama")  # a small model's steps are short: runs as long as num_scheduler_steps allows
    prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a bright cold day"]
    with LLM(path, max_model_len=256, num_kv_blocks=128) as llm:
        probe = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0]
    stop_token, stop_text = probe.token_ids[20], llm_text_piece(path, probe.token_ids[33:35])
    params = [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=41, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=23, presence_penalty=0.5, logit_bias={5: 3.0}),
        SamplingParams(temperature=0, max_tokens=60, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=60, min_tokens=5, stop_token_ids=[stop_token]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=3),
    ]
    runs = {}
    for steps in (1, 8):
        with LLM(path, max_model_len=256, num_kv_blocks=128, num_scheduler_steps=steps) as llm:
            outs = llm.generate(prompts + prompts[3:] + prompts[:1], params, use_tqdm=False)
            runs[steps] = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]
            runs[steps, "stats"] = llm.last_stats
    assert runs[8] == runs[1]
    assert runs[1, "stats"].steps_in_runs == 0 and runs[8, "stats"].steps_in_runs > runs[8, "stats"].steps // 3
    reasons = [c[1:3] for o in runs[1] for c in o]
    assert ("stop", stop_text) in reasons and ("stop", stop_token) in reasons and ("length", None) in reasons


def llm_text_piece(path, token_ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(token_ids)
