"""Block placement: what first-fit and best-fit buy over `lru`, measured.

    python -m pagedllm.benchmarks.bench_placement [--requests 1000]

1. On the 1,000-request memory trace (benchmarks/kv_memory.py, the real scheduler): how
   contiguous live block tables are (blocks per run of consecutive ids), internal waste and
   external fragmentation, per policy.
2. The `cpu` backend's decode attention over 64 requests x 1,024 tokens, float32 and bfloat16
   K/V, with contiguous block tables (each request's blocks one run) and scattered ones (a
   random permutation), with and without the kernel's prefetch of the next block, rounds
   alternated; as bandwidth against a streaming read of the same bytes.
3. Swap-out and swap-in of 1,024 blocks whose ids are one run, against scattered ids.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps, native
from pagedllm.core.config import PLACEMENTS

from .kv_memory import measure_kv_utilisation, print_placements


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


ATTENTION_VARIANTS = (("contiguous", True), ("scattered", True), ("contiguous", False), ("scattered", False))


def _variant_label(table: str, prefetch: bool) -> str:
    return table if prefetch else f"{table}, no prefetch"


def decode_attention_ms(
    requests: int = 64,
    context: int = 1024,
    block_size: int = 16,
    heads: int = 8,
    head_size: int = 64,
    rounds: int = 7,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Decode attention with contiguous and scattered block tables, each with the kernel's
    prefetch of the next block and without it, rounds alternated."""
    blocks_each = context // block_size
    num_blocks = 1 + requests * blocks_each
    kv_cache = torch.randn(2, num_blocks, block_size, heads, head_size).to(dtype)
    query = torch.randn(requests, heads, head_size).to(dtype)
    ids = torch.arange(1, num_blocks, dtype=torch.int32)
    tables = {
        "contiguous": ids.view(requests, blocks_each),
        "scattered": ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))].view(
            requests, blocks_each
        ),
    }
    ops = CpuAttentionOps()
    lens = torch.full((requests,), context, dtype=torch.int32)
    scale = head_size**-0.5
    out: dict[str, list[float]] = {_variant_label(*v): [] for v in ATTENTION_VARIANTS}
    kernel = native.unavailable_reason() is None
    try:
        for _ in range(3):  # alternate, so that drift in the machine's speed hits all alike
            for table, prefetch in ATTENTION_VARIANTS:
                if not kernel and not prefetch:
                    continue
                if kernel:
                    native.set_prefetch(prefetch)
                meta = DecodeMetadata(block_tables=tables[table], context_lens=lens, max_context_len=context)
                out[_variant_label(table, prefetch)].append(
                    _median_ms(lambda m=meta: ops.decode_attention(query, kv_cache, m, scale), rounds)
                )
    finally:
        if kernel:
            native.set_prefetch(True)
    return {name: min(v) for name, v in out.items() if v}


def streaming_read_ms(nbytes: int, rounds: int = 7) -> float:
    """A sum over a float32 tensor of nbytes: reading memory at the speed torch's reduction gets."""
    x = torch.randn(nbytes // 4)
    return min(_median_ms(x.sum, rounds) for _ in range(3))


def swap_ms(num_blocks: int = 4097, moved: int = 1024, block_size: int = 16, rounds: int = 7) -> dict[str, float]:
    """One layer-stacked pool (4 layers), the swap space as big as what moves."""
    device = torch.randn(4, 2, num_blocks, block_size, 8, 64)
    host = torch.zeros(4, 2, moved, block_size, 8, 64)
    ops = CpuAttentionOps()
    rng = torch.Generator().manual_seed(0)
    runs = {
        "contiguous": list(range(1, 1 + moved)),
        "scattered": (torch.randperm(num_blocks - 1, generator=rng)[:moved] + 1).tolist(),
    }
    out = {}
    for name, ids in runs.items():
        pairs_out = list(zip(ids, range(moved)))
        pairs_in = [(s, d) for d, s in pairs_out]
        out[f"swap-out {name}"] = _median_ms(lambda p=pairs_out: ops.swap_blocks(device, host, p), rounds)
        out[f"swap-in {name}"] = _median_ms(lambda p=pairs_in: ops.swap_blocks(host, device, p), rounds)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args(argv)
    print(f"1. memory trace, {args.requests} requests:")
    print_placements([measure_kv_utilisation(num_requests=args.requests, placement=p) for p in PLACEMENTS])
    requests, context, heads, head_size = 64, 1024, 8, 64
    for dtype in (torch.float32, torch.bfloat16):
        attention = decode_attention_ms(requests, context, heads=heads, head_size=head_size, dtype=dtype)
        kv_bytes = 2 * requests * context * heads * head_size * dtype.itemsize
        read_ms = streaming_read_ms(kv_bytes)
        print(f"2. cpu decode attention, {requests} requests x {context:,} tokens, {str(dtype)[6:]} K/V:")
        print(f"   {'streaming read of the same bytes':<34} {read_ms:8.2f} ms  {kv_bytes / read_ms / 1e6:6.1f} GB/s")
        for name, ms in attention.items():
            print(f"   {name:<34} {ms:8.2f} ms  {kv_bytes / ms / 1e6:6.1f} GB/s  ({read_ms / ms:.0%} of the read)")
        print(f"   scattered / contiguous: {attention['scattered'] / attention['contiguous']:.2f}")
    print("3. moving 1,024 blocks (4 layers, 8 KV heads of 64, block size 16):")
    for name, ms in swap_ms().items():
        print(f"   {name:<22} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
