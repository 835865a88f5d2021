"""A request's tokens and logprobs on the `cpu` backend do not depend on what runs beside it:
the same bits alone on an idle engine and inside a batch of others (their prefills and decodes
in its steps), dense and mixture-of-experts models, float32 and bfloat16."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

PROBE = [5 + (7 * i) % 300 for i in range(41)]


def others(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 390) for _ in range(rng.randrange(4, 90))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_requests_tokens_and_logprobs_are_the_same_bits_alone_and_in_a_batch(tiny_model, arch, dtype):
    """The experts' GEMMs see as many rows as the batch routes to them: on a kernel whose
    result depended on the row count, a token's logprobs would move with its neighbours."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with LLM(tiny_model(arch), dtype=dtype, kv_cache_memory="64MiB", skip_tokenizer_init=True) as llm:
        (alone,) = llm.generate([PROBE], params, use_tqdm=False)
        batch = others(12, seed=1)
        outs = llm.generate(batch[:5] + [PROBE] + batch[5:], params, use_tqdm=False)
        beside = outs[5]
    got, want = beside.outputs[0], alone.outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs  # every entry's float, bit for bit
    assert beside.prompt_logprobs == alone.prompt_logprobs
