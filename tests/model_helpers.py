"""Drive a ModelRunner directly (no scheduler): each request gets its own shuffled blocks."""

from __future__ import annotations

import random

import torch

from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.core.utils import cdiv


def make_runner(
    model_dir: str,
    dtype: str | None = None,
    num_blocks: int = 256,
    block_size: int = 16,
    ops=None,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    model = load_model(model_dir, dtype=dtype)
    kv = allocate_kv_caches(model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(model, ops or CpuAttentionOps(), kv, block_size, kv_cache_dtype=kv_cache_dtype)


def shuffled_tables(num_requests: int, blocks_each: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    ids = list(range(1, num_blocks))  # block 0 is the null block
    random.Random(seed).shuffle(ids)
    return [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(num_requests)]


def greedy_batched(
    runner: ModelRunner, prompts: list[list[int]], max_new: int, start_steps: list[int] | None = None
) -> list[list[int]]:
    """Greedy decoding of all prompts in shared steps. Request i joins at step start_steps[i],
    so batches mix prefills of newcomers with decodes of the others."""
    bs = runner.block_size
    blocks_each = cdiv(max(map(len, prompts)) + max_new, bs)
    tables = shuffled_tables(len(prompts), blocks_each, runner.kv_caches.shape[2])
    start_steps = start_steps or [0] * len(prompts)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    step = 0
    while any(len(t) - len(p) < max_new for t, p in zip(tokens, prompts)):
        active = [
            i for i in range(len(prompts)) if start_steps[i] <= step and len(tokens[i]) - len(prompts[i]) < max_new
        ]
        if active:
            seqs = [SeqInput(tokens[i][computed[i] :], computed[i], tables[i]) for i in active]
            logits = runner.execute(seqs)
            for row, i in enumerate(active):
                computed[i] = len(tokens[i])
                tokens[i].append(int(logits[row].argmax()))
        step += 1
    return [t[len(p) :] for t, p in zip(tokens, prompts)]


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def random_prompt(n: int, seed: int, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def assert_chunk_logits_match(runner: ModelRunner, hf_model, prompt: list[int], ends: list[int]) -> None:
    """The prompt prefilled in chunks ending at `ends`: each chunk's last logits are those of
    transformers' one forward pass over the whole prompt."""
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    (table,) = shuffled_tables(1, cdiv(len(prompt), runner.block_size), runner.kv_caches.shape[2], seed=4)
    start = 0
    for end in ends:
        logits = runner.execute([SeqInput(prompt[start:end], start, table)])[0]
        assert (logits - ref[end - 1]).abs().max() <= 1e-4, f"chunk ending at {end}"
        start = end


def assert_matches_transformers(runner: ModelRunner, hf_model, max_new: int) -> tuple[list, list]:
    """A 70-token prompt in three chunks, then three prompts (5, 17, 40 tokens) decoded
    together, joining at different steps, against transformers' generate alone. Returns the
    prompts and the runner's tokens."""
    assert_chunk_logits_match(runner, hf_model, random_prompt(70, seed=1), [23, 50, 70])
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate((5, 17, 40))]
    ours = greedy_batched(runner, prompts, max_new=max_new, start_steps=[0, 1, 3])
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf_model, prompt, max_new), f"prompt of {len(prompt)} tokens"
    return prompts, ours
