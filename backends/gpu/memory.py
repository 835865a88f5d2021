"""Sizing the KV pool on a GPU: what the device's memory leaves after the model and one step."""

from __future__ import annotations

import torch

from pagedllm.core.utils import cdiv

from ..runner import ModelRunner, SeqInput, allocate_kv_caches


@torch.inference_mode()
def profile_num_blocks(
    model,
    ops,
    block_size: int,
    slot_bytes: int,
    num_tokens: int,
    max_seq_len: int,
    memory_utilization: float,
    device="cuda",
) -> int:
    """Run one prefill of `num_tokens` (the most a step computes) and give the KV pool, at
    `slot_bytes` per token slot (KVSpec.bytes_per_block_slot), what
    the device's memory, times `memory_utilization`, leaves after weights, the activations'
    peak and memory outside torch."""
    seqs, left = [], num_tokens
    while left > 0:
        n = min(left, max_seq_len - 1)
        seqs.append(n)
        left -= n
    blocks_needed = sum(cdiv(n, block_size) for n in seqs) + 1
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    scratch = allocate_kv_caches(model, blocks_needed, block_size, device=device)
    runner = ModelRunner(model, ops, scratch, block_size, device)
    next_block, batch = 1, []
    for n in seqs:
        blocks = list(range(next_block, next_block + cdiv(n, block_size)))
        next_block += len(blocks)
        batch.append(SeqInput([1] * n, 0, blocks))
    runner.execute(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
    del runner, scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside_torch = total - free - torch.cuda.memory_reserved()
    budget = total * memory_utilization - peak - outside_torch
    blocks = int(budget // (slot_bytes * block_size))
    if blocks < 2:
        raise RuntimeError(
            f"no room for a KV cache: {memory_utilization:.0%} of {total / 2**30:.1f} GiB is "
            f"{total * memory_utilization / 2**30:.1f} GiB, the model and a step need "
            f"{(peak + outside_torch) / 2**30:.1f} GiB; raise --gpu-memory-utilization"
        )
    return blocks
