"""Sliding-window attention end to end: the runner against transformers on models whose layers
are all windowed (Mistral) or some of them (Qwen2's max_window_layers), and the engine holding
only the window's blocks while generating far past it."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.core.utils import cdiv
from pagedllm.fixtures.tiny_models import load_hf

from model_helpers import assert_matches_transformers, greedy_batched, make_runner, random_prompt


def teacher_forced_argmax(hf, tokens: list[int]) -> list[int]:
    """transformers' greedy choice after each prefix of `tokens`, from one forward pass."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


@pytest.mark.parametrize(
    "arch,config",
    [
        ("mistral", dict(sliding_window=12)),  # every layer, a window shorter than a block
        ("qwen2", dict(use_sliding_window=True, sliding_window=21, max_window_layers=1)),  # layer 1 only
    ],
)
def test_windowed_models_match_transformers_in_prefill_chunks_and_batches(tiny_model, arch, config):
    path = tiny_model(arch, **config)
    hf = load_hf(path)
    runner = make_runner(path)
    want = [None, 21] if arch == "qwen2" else [12, 12]
    assert [layer.window for layer in runner.model.layers] == want
    prompts, ours = assert_matches_transformers(runner, hf, max_new=20)  # chunks that start past the window
    # the windows matter here: attending to the whole context gives other tokens
    full = make_runner(path)
    for layer in full.model.layers:
        layer.attn_options = {}
    assert greedy_batched(full, prompts, max_new=20, start_steps=[0, 1, 3]) != ours


def test_a_backend_without_windows_is_refused_a_windowed_model(tiny_model, plugins_installed):
    """A port whose kernels do not take the window (or do not declare it) is refused at start."""
    from pagedllm.backends.worker import Worker
    from pagedllm.core.config import EngineConfig

    class OldKernels(CpuAttentionOps):
        def decode_attention(self, query, kv_cache, meta, scale):
            return super().decode_attention(query, kv_cache, meta, scale)

    assert OldKernels().unsupported_features({"sliding_window"}) == (
        "sliding-window attention (AttentionOps.supports_sliding_window)"
    )
    assert CpuAttentionOps().unsupported_features({"sliding_window", "soft_cap"}) is None
    path = tiny_model("mistral", sliding_window=12)
    with pytest.raises(ValueError, match="does not support sliding-window attention"):
        Worker(EngineConfig(model=path, backend="broken-no-softmax-scale"))


def test_mistral_window_generates_2048_tokens_like_transformers_holding_the_window_and_one_block(tiny_model):
    """A 256-token window, 2,048 greedy tokens after a 100-token prompt: every token is
    transformers' greedy choice (checked in one forward pass over the whole sequence under
    its sliding-window mask), and the request never holds more than its window, one block and
    a decode run's slots (in a pool that could not hold a tenth of its context; runs of 8 steps
    hold at most one block more than single steps). Then n = 3 greedy samples of a
    prompt past the window: the forks share its blocks and each releases them behind its
    window; every sample is transformers' continuation, and at the end no block is held."""
    window, block_size = 256, 16
    path = tiny_model("mistral", sliding_window=window, max_position_embeddings=4096)
    prompt, forked = random_prompt(100, seed=2), random_prompt(300, seed=5)
    params = SamplingParams(max_tokens=2048, temperature=0, ignore_eos=True)
    run = 8  # decode runs' steps: a run allocates the slots of all of them when it starts
    engine = dict(block_size=block_size, num_kv_blocks=64, max_num_batched_tokens=512, enable_prefix_caching=False)
    with LLM(path, **engine, num_scheduler_steps=run) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        stats = llm.last_stats.scheduler
        samples = llm.generate(
            [{"prompt_token_ids": forked}], SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
        )[0].outputs
        after_forks = llm.last_stats.scheduler
    assert len(out) == 2048
    assert stats.peak_blocks_used <= cdiv(window + run - 1, block_size) + 1, stats  # run = 1: window + one block
    hf = load_hf(path)
    tokens = prompt + list(out)
    predicted = teacher_forced_argmax(hf, tokens[:-1])[len(prompt) - 1 :]
    first_wrong = next((i for i, (a, b) in enumerate(zip(predicted, out)) if a != b), None)
    assert first_wrong is None, f"token {first_wrong} of 2048 is not transformers' choice"
    want = teacher_forced_argmax(hf, forked + list(samples[0].token_ids)[:-1])[len(forked) - 1 :]
    assert [list(c.token_ids) for c in samples] == [want] * 3
    assert after_forks.kv_cache_usage == 0.0 and after_forks.num_running == 0


def test_a_follow_up_turn_longer_than_the_pool_hits_the_prefix_cache_and_matches_transformers(tiny_model):
    """Prefix caching on, a pool of 9 blocks (144 tokens) under a 32-token window: turn two is
    turn one's whole history (its blocks all cached) and 60 tokens more, 190 tokens in all. Its
    hits behind the window are not revived: it starts (it used to wait for ever, and every
    request behind it), and its tokens are transformers' under the window's mask."""
    window = 32
    path = tiny_model("mistral", sliding_window=window, max_position_embeddings=1024)
    prompt = random_prompt(100, seed=11)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = dict(block_size=16, num_kv_blocks=10, max_num_batched_tokens=64, max_model_len=512)
    with LLM(path, **engine) as llm:
        first = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        follow_up = prompt + list(first) + random_prompt(70, seed=12)
        second, behind = llm.generate([{"prompt_token_ids": follow_up}, {"prompt_token_ids": prompt[:5]}], params)
    assert len(follow_up) > 9 * 16
    assert second.num_cached_tokens >= 112, second.num_cached_tokens
    hf = load_hf(path)
    out = list(second.outputs[0].token_ids)
    assert teacher_forced_argmax(hf, follow_up + out[:-1])[len(follow_up) - 1 :] == out
    assert len(behind.outputs[0].token_ids) == 20
