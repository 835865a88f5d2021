"""Prompt logprobs (how evaluation harnesses score text) against transformers: across prefill
chunks, with a prefix cache that holds the prompt, with n > 1, and past the worker's slices."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.fixtures.tiny_models import load_hf


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = load_hf(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1


def test_prompt_logprobs_equal_transformers_across_chunks_with_a_warm_prefix_cache(model):
    """Each 64-token chunk keeps 65 rows (its last as the sequence's last and as a prompt row)."""
    prompt = [(7 * i) % 390 + 3 for i in range(300)]  # more positions than one slice of the worker's (256)
    expected = hf_prompt_logprobs(model, prompt)
    # max_num_seqs=8: the cpu replay's buffers start at 8 rows, fewer than a chunk keeps (64 + 1)
    with LLM(model, max_num_batched_tokens=64, num_kv_blocks=96, max_model_len=512, max_num_seqs=8) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt is now cached
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, "prompt logprobs are computed, never read from the cache"
        plain = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        entry, row = lps[p], expected[p - 1]
        token = prompt[p]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = [t for t, lp in entry.items() if lp.rank in (1, 2) and (t != token or lp.rank <= 2)]
        assert set(row.topk(2).indices.tolist()) <= set(top) | {token}
        assert len(entry) in (2, 3)  # the top two, and the prompt token when it is not among them
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)
