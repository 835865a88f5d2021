"""Backends with one classic bug each (the conformance suite must catch every one), and two
that crash (the engine must give up on them cleanly)."""

import os
from dataclasses import replace

from pagedllm.backends.cpu import CpuAttentionOps


class SlotOffByOne(CpuAttentionOps):
    """Writes each token one slot past the one the core chose."""

    name = "broken-slot-off-by-one"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        limit = kv_cache.shape[1] * kv_cache.shape[2] - 1
        super().write_kv(key, value, kv_cache, (slot_mapping + 1).clamp(max=limit))


class NoSoftmaxScale(CpuAttentionOps):
    """Forgets the 1/sqrt(head_size) scale before the softmax."""

    name = "broken-no-softmax-scale"

    def decode_attention(self, query, kv_cache, meta, scale):
        return super().decode_attention(query, kv_cache, meta, 1.0)

    def prefill_attention(self, query, kv_cache, meta, scale):
        return super().prefill_attention(query, kv_cache, meta, 1.0)


def _first_block_everywhere(tables):
    tables = tables.clone()
    tables[:, 1:] = tables[:, :1]
    return tables


class FirstBlockOnly(CpuAttentionOps):
    """Reads a request's first block in place of all the others."""

    name = "broken-first-block-only"

    def decode_attention(self, query, kv_cache, meta, scale):
        return super().decode_attention(
            query, kv_cache, replace(meta, block_tables=_first_block_everywhere(meta.block_tables)), scale
        )

    def prefill_attention(self, query, kv_cache, meta, scale):
        return super().prefill_attention(
            query, kv_cache, replace(meta, block_tables=_first_block_everywhere(meta.block_tables)), scale
        )


class NeedsHardware(CpuAttentionOps):
    """A backend for hardware this machine does not have."""

    name = "needs-hardware"

    @staticmethod
    def unavailable_reason():
        return "no XPU device"


class CrashOnStart(CpuAttentionOps):
    """A backend whose worker fails while starting, every time (as a missing kernel would)."""

    name = "crash-on-start"

    def __init__(self):
        raise RuntimeError("crash-on-start: its kernels are missing")


class CrashMidRun(CpuAttentionOps):
    """A backend whose worker process dies at its first decode, every time."""

    name = "crash-mid-run"

    def decode_attention(self, query, kv_cache, meta, scale):
        os._exit(3)
