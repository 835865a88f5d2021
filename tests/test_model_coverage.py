"""Gemma 2 and 3, Mixtral, Qwen3-MoE and Phi-3 against transformers on odd-shaped random
models: head sizes 80 and 96, GQA and MQA, a 400-token vocabulary, windows shorter than the
prompts, soft-capped scores and logits, 4 experts top-2 renormalised and 8 experts top-1 not,
projections saved fused and LongRoPE."""

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.models.config import ModelConfig
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, allocate_kv_caches
from pagedllm.fixtures.tiny_models import load_hf

from model_helpers import (
    assert_chunk_logits_match,
    assert_matches_transformers,
    greedy_batched,
    hf_greedy,
    make_runner,
    random_prompt,
)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mixtral", "qwen3-moe"])
def test_prefill_chunks_and_batched_greedy_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    assert_matches_transformers(make_runner(path), load_hf(path), max_new=16)  # chunks past every window


@pytest.mark.parametrize("arch,blocks", [("gemma2", 24), ("mixtral", 10)])
def test_engine_tokens_and_top5_logprobs_under_preemption_and_prefix_hits(tiny_model, arch, blocks):
    """Through the engine: six requests whose prompts share 48 tokens, in a pool that forces
    preemption and steps that chunk the prompts; each request's greedy tokens and top-5
    logprobs are transformers' (one forward pass over prompt + output). Mixtral's window is on
    every layer, so its requests hold only their windows' blocks: a smaller pool."""
    path = tiny_model(arch)
    shared = random_prompt(48, seed=3)
    prompts = [shared + random_prompt(5 + 9 * i, seed=20 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    engine = dict(num_kv_blocks=blocks, max_num_batched_tokens=48, max_model_len=256, skip_tokenizer_init=True)
    with LLM(path, **engine) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.last_stats.scheduler
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    hf = load_hf(path)
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        want = torch.log_softmax(logits.float(), dim=-1)
        assert tokens == want.argmax(-1).tolist()
        for step, top in enumerate(out.outputs[0].logprobs):
            values, ids = want[step].topk(5)
            assert set(ids.tolist()) <= set(top), f"step {step}"
            for i, v in zip(ids.tolist(), values.tolist()):
                assert math.isclose(top[i].logprob, v, abs_tol=1e-4), (step, i)


def test_phi3_fused_projections_and_longrope_short_and_long_factors(tiny_model):
    """Phi-3's LongRoPE takes one set of factors for the engine's life: the short ones when
    max_model_len is within the pretraining length (64 here) — transformers' generation too,
    while a sequence stays within it — and the long ones past it, which transformers uses for
    a sequence longer than that (here one forward pass over 100 tokens)."""
    path = tiny_model("phi3")
    hf = load_hf(path)

    def runner(max_model_len):
        model = load_model(path, max_positions=max_model_len)
        return ModelRunner(model, CpuAttentionOps(), allocate_kv_caches(model, 64, 16), 16)

    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate((5, 17, 40))]
    ours = greedy_batched(runner(64), prompts, max_new=20, start_steps=[0, 1, 3])
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 20), f"prompt of {len(prompt)} tokens"
    assert_chunk_logits_match(runner(1024), hf, random_prompt(100, seed=1), [23, 70, 100])


def test_unsupported_variants_are_refused_naming_the_field():
    base = dict(vocab_size=400, hidden_size=64, intermediate_size=48, num_hidden_layers=2)
    base.update(num_attention_heads=4, num_local_experts=4, num_experts_per_tok=2)
    for change, field in (
        (dict(hidden_act="relu"), "hidden_act 'relu'"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dict({**base, **change, "architectures": ["MixtralForCausalLM"]})
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.75"):
        ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "rope_parameters": rope})
    qwen = {**base, "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 16}
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict({**qwen, "shared_expert_intermediate_size": 32})
