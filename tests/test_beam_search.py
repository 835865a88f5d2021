"""Beam search through the real engine against transformers' generate(num_beams=W)."""

import random

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from pagedllm.fixtures.tiny_models import load_hf

LENGTHS = [1, 15, 16, 17, 100]
MAX_TOKENS = 12


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def hf_beams(hf, p, width, eos=None) -> list[list[int]]:
    out = hf.generate(
        torch.tensor([p]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=1.0,
        max_new_tokens=MAX_TOKENS,
        eos_token_id=eos,
        pad_token_id=0,
    )
    beams = []
    for row in out[:, len(p) :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]  # what follows an early EOS is padding
        beams.append(row)
    return beams


def ours(llm, p, width, ignore_eos) -> list[list[int]]:
    out = llm.beam_search([p], BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos))[0]
    assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    return [s.tokens[len(p) :] for s in out.sequences]


@pytest.fixture(scope="module")
def plain(tiny_model):
    path = tiny_model("llama")
    return path, load_hf(path)


@pytest.fixture(scope="module")
def with_eos(tiny_model, plain):
    """The same weights, with an EOS token the beams actually reach: one they pick early on."""
    _, hf = plain
    early = [t for i, n in enumerate(LENGTHS) for beam in hf_beams(hf, prompt(n, i), 4) for t in beam[1:6]]
    eos = max(set(early), key=early.count)
    path = tiny_model("llama", eos_token_id=eos)
    return path, load_hf(path), eos


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_without_eos(plain, width):
    path, hf = plain
    with LLM(path, num_kv_blocks=128, max_model_len=256) as llm:
        for i, n in enumerate(LENGTHS):
            p = prompt(n, i)
            assert ours(llm, p, width, ignore_eos=True) == hf_beams(hf, p, width), f"prompt of {n} tokens"


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_with_eos_in_play(with_eos, width):
    path, hf, eos = with_eos
    ended_early = 0
    with LLM(path, num_kv_blocks=128, max_model_len=256) as llm:
        for i, n in enumerate(LENGTHS):
            p = prompt(n, i)
            got = ours(llm, p, width, ignore_eos=False)
            assert got == hf_beams(hf, p, width, eos), f"prompt of {n} tokens"
            ended_early += sum(len(b) < MAX_TOKENS for b in got)
    assert ended_early, "EOS never ended a beam: the test would not test EOS"


def test_beams_survive_forced_preemption(plain):
    """Five searches of 4 beams over 100-token prompts need ~50 blocks at once; with 39 a
    group is preempted mid-search (as a whole) and recomputed — the beams must not change."""
    path, hf = plain
    prompts = [prompt(100, 20 + k) for k in range(5)]
    with LLM(path, num_kv_blocks=40, max_model_len=128) as llm:
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert llm.last_stats.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for p, out in zip(prompts, outs):
        assert [s.tokens[len(p) :] for s in out.sequences] == hf_beams(hf, p, 4)


def test_beams_share_blocks(plain):
    """Width 4, a 256-token prompt, 64 tokens: peak blocks near prompt + 4 x (generated + 1),
    far from 4 x (prompt + generated)."""
    path, _ = plain
    with LLM(path, num_kv_blocks=200, max_model_len=512, enable_prefix_caching=False) as llm:
        llm.beam_search([prompt(256, 5)], BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True))
        peak = llm.last_stats.scheduler.peak_blocks_used
    prompt_blocks, generated_blocks = 256 // 16, 64 // 16
    assert peak <= prompt_blocks + 4 * (generated_blocks + 1), peak
    assert peak < 4 * (prompt_blocks + generated_blocks) / 2


def test_bad_beam_params_name_the_field():
    from pagedllm import InvalidParameter

    with pytest.raises(InvalidParameter, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidParameter, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
