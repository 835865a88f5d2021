"""The same workload through transformers, for comparison: static batches (padding) and
transformers' own continuous batching. Only the tokens each request asked for count."""

from __future__ import annotations

import time

import torch


def _greedy_config(model, max_new_tokens: int):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0, bos_token_id=model.config.bos_token_id)


@torch.inference_mode()
def hf_static(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int):
    """transformers generate() over fixed batches in arrival order; each batch runs until its
    longest request is done. Returns (seconds, useful output tokens, tokens per request)."""
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        wants = max_tokens[start:start + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(model, max(wants)))
        for i, want in enumerate(wants):
            outputs.append(out[i, width:width + want].tolist())
    return time.perf_counter() - t0, outputs


@torch.inference_mode()
def hf_continuous(model, prompts: list[list[int]], max_tokens: list[int]):
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    cfg = _greedy_config(model, max(max_tokens))
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        while len(outputs) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
    seconds = time.perf_counter() - t0
    ordered = [outputs.get(f"r{i}", [])[:m] for i, m in enumerate(max_tokens)]
    return seconds, ordered
