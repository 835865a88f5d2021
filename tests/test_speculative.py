"""Speculative decoding (n-gram and draft model; greedy and sampled): the proposer, the
configuration's refusals, the verification's distribution, and engines started with and
without speculation giving the same tokens — through preemption, prefix hits, stops inside a
kept run, length limits, a windowed model, two ranks and forks — with the proposals' counts in
the stats and at /metrics."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backends.sampler import Sampler, SamplingRow, probabilities
from pagedllm.backends.speculation.verify import verify
from pagedllm.benchmarks.bench_speculative import quoting_prompts
from pagedllm.core.config import parse_speculative_config
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.scheduling.speculation import propose_ngram
from pagedllm.entrypoints.metrics import EngineMetrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_prompt_lookup_takes_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]
    assert propose_ngram([9, 1, 2, 8, 3, 7, 1, 2], 2, 2, 4) == [8, 3]
    assert propose_ngram([9, 1, 2, 8, 3, 7, 1, 2], 2, 3, 4) == []  # no earlier run of 3
    assert propose_ngram([5, 1, 6, 2, 1, 7, 5, 1], 2, 1, 4) == [6, 2]  # [5, 1] beats the later [1]
    assert propose_ngram([1, 4, 1, 5, 1], 1, 1, 1) == [5]  # the latest of equal matches
    assert propose_ngram([5, 6, 7], 3, 1, 4) == [] and propose_ngram([5], 3, 1, 4) == []


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "/some/draft"}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
        ('{"method": "ngram",', "speculative_config"),
        ({"method": "ngram", "lookahead": 3}, "speculative_config"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_its_field(value, field):
    with pytest.raises(InvalidParameter) as e:
        parse_speculative_config(value)
    assert e.value.field == field


def looping_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated runs (so proposals are found) and a shared prefix (prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, 390) for _ in range(40)]
    prompts = []
    for i in range(n):
        motif = [rng.randrange(5, 390) for _ in range(rng.randrange(3, 9))]
        body = motif * rng.randrange(2, 6) + [rng.randrange(5, 390) for _ in range(rng.randrange(1, 30))]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


def generate(path, prompts, params, **engine):
    with LLM(path, skip_tokenizer_init=path is not None, **engine) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0] for o in out], llm.last_stats


DEMO_DRAFT = {"model": "demo-draft", "num_speculative_tokens": 3}


@pytest.mark.parametrize("model", ["demo", "mistral-window"])
def test_tokens_are_those_without_speculation_through_preemption_and_prefix_hits(tiny_model, model):
    """A pool small enough to preempt, prompts sharing a prefix, mixed lengths; greedy requests
    with a length limit, some with a stop token, and seeded sampled ones (top-p, top-k, a
    repetition penalty, min_tokens, logprobs), whose positions are drawn with the randomness
    plain decoding uses there: the same tokens, finish and stop reasons, and logprobs, with
    speculation as without. The demo model, on text that quotes itself, keeps some n-gram and
    some draft-model proposals; the random windowed model rejects nearly all, and rolls them
    back in tables whose early blocks were released behind the window."""
    if model == "demo":
        path, prompts, configs = None, quoting_prompts(6, chars=600), (NGRAM, DEMO_DRAFT)
        engine = dict(num_kv_blocks=48, max_model_len=512, max_num_batched_tokens=256)
    else:
        path, prompts, configs = tiny_model("mistral", sliding_window=24), looping_prompts(12), (NGRAM,)
        engine = dict(num_kv_blocks=40, max_model_len=256, max_num_batched_tokens=96)
    params = [
        SamplingParams(
            temperature=0, max_tokens=30 + 7 * i, ignore_eos=True, stop_token_ids=[11 + i] if i % 4 else None
        )
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=48, ignore_eos=True)
    params[2] = SamplingParams(temperature=0.5, top_k=20, seed=2, max_tokens=48, logprobs=2, ignore_eos=True)
    params[3] = SamplingParams(temperature=0.6, repetition_penalty=1.1, seed=3, max_tokens=48, ignore_eos=True)
    params[5] = SamplingParams(temperature=0.4, seed=4, max_tokens=48, min_tokens=40, stop_token_ids=[2, 3, 4])
    plain, _ = generate(path, prompts, params, **engine)
    for config in configs:
        spec, stats = generate(path, prompts, params, **engine, speculative_config=config)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], config
        assert [(o.finish_reason, o.stop_reason) for o in spec] == [(o.finish_reason, o.stop_reason) for o in plain]
        _assert_same_logprobs(spec[2], plain[2])
        counts = stats.scheduler.spec_decode
        assert counts.num_drafts > 0 and counts.num_accepted_tokens <= counts.num_draft_tokens
        assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
        assert stats.scheduler.prefix_cache_hits > 0
        if model == "demo":  # (the windowed model releases blocks behind its window: that pool stays roomy)
            assert counts.num_accepted_tokens > 0 and stats.scheduler.num_preemptions > 0
        assert stats.scheduler.kv_cache_usage == 0.0  # every block back, rolled-back ones included
    metrics = EngineMetrics("m")  # what /metrics shows of them
    metrics.observe_stats(stats)
    text = metrics.render().decode()
    assert (
        f'pagedllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(counts.num_accepted_tokens)}' in text
    )
    assert f'pagedllm:spec_decode_num_drafts_total{{model_name="m"}} {float(counts.num_drafts)}' in text
    first = counts.num_accepted_tokens_per_pos[0]
    assert (
        f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text
    )


def _assert_same_logprobs(a, b):
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()  # the sampled token and the top 2, the same ones
        assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-3) for t in x)  # float32, two ranks


def test_two_ranks_and_requests_that_do_not_speculate_beside_those_that_do():
    """Tensor parallelism (rank 0 decides, the other learns the kept tokens; with a draft model,
    rank 0 runs the draft and the other learns its proposals) with greedy, sampled and logprob
    requests speculating beside a constrained one, which decodes one token a step as before.
    Compared with two ranks without speculation: where the CPU multiplies bfloat16, the demo
    model's layers round their inputs to bfloat16 (as transformers does), and the ranks' partial
    sums, added in another order than one rank's, can flip a token one bfloat16 step from a tie."""
    path, prompts = None, quoting_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    params[2] = SamplingParams(temperature=0, logprobs=2, max_tokens=40, ignore_eos=True)
    params[3] = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "[a-z ]{10,30}"})
    plain, _ = generate(path, prompts, params, tensor_parallel_size=2)
    for config in (NGRAM, DEMO_DRAFT):  # the draft runs whole on rank 0, which shares its proposals
        spec, stats = generate(path, prompts, params, tensor_parallel_size=2, speculative_config=config)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], config
        assert stats.scheduler.spec_decode.num_accepted_tokens > 0
        _assert_same_logprobs(spec[2], plain[2])


def _redraw_including_the_rejected(sampler, logits, rows, proposals):
    """A planted bug: keeps a proposed token d with probability p(d), as it should, but on a
    rejection draws again from p itself instead of p without d (d comes out too often)."""
    gen = torch.Generator().manual_seed(0)
    results = []
    for row_logits, row, proposal in zip(logits, rows, proposals):
        probs = probabilities([row.params] * len(row_logits), row_logits)
        tokens = []
        for j, p in enumerate(probs):
            if j < len(proposal) and torch.rand((), generator=gen) < p[proposal[j]]:
                tokens.append(proposal[j])
                continue
            tokens.append(int(torch.multinomial(p, 1, generator=gen)))
            break
        results.append((tokens, [None] * len(tokens)))
    return results


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens p allows, and its degrees of freedom; a token p
    forbids must never be drawn."""
    allowed = probs > 0
    assert counts[~allowed].sum() == 0
    expected = probs[allowed] * counts.sum()
    return float(((counts[allowed] - expected) ** 2 / expected).sum()), int(allowed.sum()) - 1


# Pearson's statistic above which a right sampler lands once in 10,000 runs, by degrees of freedom
CHI2_CRITICAL = {4: 23.51, 5: 25.74}


@pytest.mark.parametrize("verifier", [verify, _redraw_including_the_rejected], ids=["real", "planted"])
def test_verified_tokens_are_distributed_as_the_targets(verifier):
    """4,000 verifications of the same two-token proposal (unseeded draws): the first token is
    distributed as the target's p0 (temperature and top-k applied), and after an accepted
    first token the second as p1; the planted sampler that redraws from p without removing the
    rejected token fails the test."""
    torch.manual_seed(3)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    proposal = [int(logits[0].argsort()[2]), int(logits[1].argsort()[-2])]  # middling tokens
    trials = 4_000
    row = SamplingRow(params, [1, 2, 3], num_prompt_tokens=3)
    results = verifier(Sampler(seed=0), [logits] * trials, [row] * trials, [proposal] * trials)
    probs = probabilities([params] * 3, logits)
    first = torch.bincount(torch.tensor([tokens[0] for tokens, _ in results]), minlength=6).double()
    kept_first = [tokens[1] for tokens, _ in results if len(tokens) > 1]
    second = torch.bincount(torch.tensor(kept_first), minlength=6).double()
    statistics = [_chi_square(first, probs[0].double()), _chi_square(second, probs[1].double())]
    passed = all(stat < CHI2_CRITICAL[df] for stat, df in statistics)
    assert passed == (verifier is verify), statistics


def test_a_draft_model_keeps_the_tokens_through_preemption_forks_and_prefix_hits(tiny_model):
    """A draft model in the same pool: the target itself as its draft (every greedy proposal
    kept: its KV, caught up lazily and cut back with the target's, is right) under recompute
    preemption, and a random one-layer draft (nearly every proposal rolled back) under swap
    preemption — greedy, seeded sampled, n = 2 and logprob requests alike get the tokens of an
    engine without speculation, and every block comes back."""
    target = tiny_model("llama")
    other = tiny_model("llama", num_hidden_layers=1, seed=1)
    prompts = looping_prompts(8)
    params = [
        SamplingParams(
            temperature=0, max_tokens=30 + 5 * i, ignore_eos=True, stop_token_ids=[11 + i] if i % 3 else None
        )
        for i in range(8)
    ]
    params[1] = SamplingParams(temperature=0.8, seed=5, max_tokens=40, n=2, ignore_eos=True)
    params[2] = SamplingParams(temperature=0.7, seed=6, max_tokens=40, logprobs=1, ignore_eos=True)
    engine = dict(num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=96)

    def tokens(**kw):
        with LLM(target, skip_tokenizer_init=True, **engine, **kw) as llm:
            out = llm.generate(prompts, params, use_tqdm=False)
            return [[c.token_ids for c in o.outputs] for o in out], llm.last_stats.scheduler

    plain, _ = tokens()
    for draft, mode in ((target, "recompute"), (other, "swap")):
        spec, stats = tokens(speculative_config={"model": draft, "num_speculative_tokens": 3}, preemption_mode=mode)
        assert spec == plain, mode
        counts = stats.spec_decode
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0
        if draft == target:  # only the sampled requests' draws differ from the greedy draft
            assert counts.num_accepted_tokens >= 0.7 * counts.num_draft_tokens
        else:
            assert counts.num_drafts > 0 and counts.num_accepted_tokens < 0.1 * counts.num_draft_tokens


def test_draft_models_the_engine_cannot_run_are_refused_naming_why(tiny_model):
    target = tiny_model("llama")
    with pytest.raises(InvalidParameter, match="not a folder"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"model": "/nonexistent/draft"})
    with pytest.raises(InvalidParameter, match="required"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"method": "draft_model"})
    other_vocab = tiny_model("llama", num_hidden_layers=1, vocab_size=500)
    with pytest.raises(Exception, match="share the target's tokenizer"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"model": other_vocab})


def test_a_prefill_asking_prompt_logprobs_beside_a_verification():
    """Chunked prefills small enough that a second request's prompt (with prompt logprobs) is
    computed in the steps where the first verifies its proposals: the worker takes both from
    one pass over the LM head, and each is what it is without speculation."""
    first, second = quoting_prompts(2)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
    ]
    results = {}
    for config in (None, NGRAM):
        with LLM(None, max_num_batched_tokens=48, num_kv_blocks=64, speculative_config=config) as llm:
            outs = llm.generate([first, second], params, use_tqdm=False)
            results[config is None] = outs, llm.last_stats.scheduler.spec_decode
    (plain, _), (spec, counts) = results[True], results[False]
    assert counts.num_drafts > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    a, b = spec[1].prompt_logprobs, plain[1].prompt_logprobs
    assert len(a) == len(b) and a[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys() and all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)
