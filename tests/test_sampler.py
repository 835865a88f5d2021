import math

import pytest
import torch

from pagedllm.backends.sampler import Sampler, SamplingRow, apply_penalties, probabilities
from pagedllm.core import SamplingParams

VOCAB = 50


def row(params, prompt=(), output=(), eos=None) -> SamplingRow:
    return SamplingRow(params, list(prompt) + list(output), len(prompt), [] if eos is None else [eos])


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    logits = logits_batch(4)
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_best():
    logits = logits_batch(1, seed=1)
    best = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(seed=3)
    rows = [SamplingRow(SamplingParams(temperature=1.5, top_k=5))] * 64
    seen = set()
    for _ in range(30):
        seen |= set(sampler(logits.expand(64, -1), rows).token_ids)
    assert seen <= best and len(seen) == 5


def test_top_p_matches_the_renormalised_nucleus():
    logits = logits_batch(1, seed=2)[0]
    top_p = 0.7
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    keep = order[: int((cumulative < top_p).sum()) + 1]  # smallest set with mass >= top_p
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[keep] = probs[keep].double() / probs[keep].sum()
    draws = 20_000
    sampler = Sampler(seed=0)
    tokens = sampler(logits.expand(draws, -1), [SamplingRow(SamplingParams(top_p=top_p))] * draws).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0, "sampled outside the nucleus"
    nz = expected > 0
    chi2 = float(((counts[nz] - draws * expected[nz]) ** 2 / (draws * expected[nz])).sum())
    dof = int(nz.sum()) - 1
    # chi-square critical value at p = 0.001 via the Wilson-Hilferty approximation
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, f"chi2 {chi2:.1f} over {critical:.1f} with {dof} dof"


def test_min_p_drops_tokens_below_the_floor():
    logits = logits_batch(1, seed=4)
    probs = probabilities([SamplingParams(min_p=0.2)], logits)[0]
    raw = logits[0].softmax(-1)
    assert torch.all(probs[raw < 0.2 * raw.max()] == 0)
    assert torch.all(probs[raw >= 0.2 * raw.max()] > 0)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_16():
    logits = logits_batch(16, seed=5)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = []
    sampler = Sampler(seed=0)
    for step in range(5):
        alone.append(sampler(logits[3:4], [row(seeded, output=[0] * step)]).token_ids[0])
    batched = []
    sampler = Sampler(seed=99)
    for step in range(5):
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=i)) for i in range(16)]
        rows[3] = row(seeded, output=[0] * step)
        batched.append(sampler(logits, rows).token_ids[3])
    assert alone == batched
    assert len(set(alone)) > 1  # the stream moves on with each generated token


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = row(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        prompt=[0],
        output=[1, 3, 3],
    )
    got = apply_penalties(logits, [r])[0]
    # token 0: prompt only -> 2/2; token 1: once in output -> -1*2 - 0.5 - 0.25;
    # token 2: unseen; token 3: twice -> 3/2 - 2*0.5 - 0.25; token 4: unseen
    expected = torch.tensor([1.0, -2.75, 0.5, 0.25, -2.0])
    assert torch.allclose(got, expected)
    assert torch.equal(apply_penalties(logits, [SamplingRow(SamplingParams())]), logits)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0
    logits[0, 8] = 9.0
    r = row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[8]), output=[1], eos=7)
    assert Sampler()(logits, [r]).token_ids == [logits[0, :7].argmax().item()]
    r.token_ids.append(2)
    assert Sampler()(logits, [r]).token_ids == [7]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_of_sampled_and_top_tokens(k):
    logits = logits_batch(2, seed=6)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=k)), SamplingRow(SamplingParams())]
    out = Sampler()(logits, rows)
    expected = logits[0].log_softmax(-1)
    lp = out.logprobs[0]
    assert lp.rank == 1 and math.isclose(lp.token_logprob, float(expected.max()), rel_tol=1e-6)
    assert lp.top_token_ids == expected.topk(k).indices.tolist() if k else lp.top_token_ids == []
    assert out.logprobs[1] is None


@pytest.mark.parametrize("dense", [True, False])
def test_logit_bias_adds_each_rows_own_bias_as_the_batch_changes(dense, monkeypatch):
    """Dense (a [rows, vocab] tensor a batch) or scattered, cached while the same requests
    sample in the same order: every row gets its own bias and no other, batch after batch."""
    from pagedllm.backends import sampler as sampler_module

    if not dense:
        monkeypatch.setattr(sampler_module, "DENSE_BIAS_BYTES", 0)
    vocab = 50
    params = [SamplingParams(temperature=0, logit_bias={3: 5.0, 7: -100.0}), SamplingParams(temperature=0)]
    params.append(SamplingParams(temperature=0, logit_bias={3: -2.5, 49: 1.0}))
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    for order in ([0, 1, 2], [0, 1, 2], [2, 0], [1], [2, 1, 0]):
        logits = torch.randn(len(order), vocab, generator=gen)
        want = logits.clone()
        for row, i in enumerate(order):
            for token, bias in (params[i].logit_bias or {}).items():
                want[row, token] += bias
        got = sampler.logit_bias(logits.clone(), [SamplingRow(params[i], [1], 1) for i in order])
        assert torch.equal(got, want), order
