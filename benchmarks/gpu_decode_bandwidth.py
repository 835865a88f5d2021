"""Decode attention on the GPU: bytes of K/V read per second by each CUDA backend's paged decode
kernel, next to the device's copy bandwidth and to torch's scaled_dot_product_attention over a
contiguous cache of the same shape (batch 64 x context 4096, head size 128, GQA 8:1, bfloat16,
block size 16, blocks scattered through the pool).

    python -m pagedllm.benchmarks.gpu_decode_bandwidth [--smoke]

--smoke: tiny shapes on the CPU through Triton's interpreter, to check this script itself.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

MAX_ERR = 0.05  # bfloat16 outputs of magnitude ~1 against SDPA


def timed(fn, device: str, repeats: int) -> float:
    """Mean seconds per call, after warm-up."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def variants(name: str, smoke: bool) -> list[tuple[str, tuple[int, int] | None]]:
    """(row label, cuda-triton's decode (tile, warps) or None for the backend as it is) for each
    configuration to time: on a GPU, cuda-triton across kernel_registers' grid (the default
    marked), so that the first GPU run shows which is fastest."""
    if name != "cuda-triton" or smoke:
        return [(f"{name} paged decode", None)]
    from pagedllm.backends.triton.ops import DECODE_TILE, DECODE_WARPS
    from pagedllm.benchmarks.kernel_registers import TRITON_CONFIGS

    default = (DECODE_TILE, DECODE_WARPS)
    return [
        (f"{name} decode {tile}x{warps}w{' (default)' if (tile, warps) == default else ''}", (tile, warps))
        for tile, warps in TRITON_CONFIGS
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        batch, context, head, kv_heads, group, block, device, repeats = 2, 160, 64, 2, 4, 16, "cpu", 1
        backends = ["cuda-triton"]
    else:
        batch, context, head, kv_heads, group, block, device, repeats = 64, 4096, 128, 8, 8, 16, "cuda", 20
        backends = ["cuda-triton", "cuda-native"]
    from pagedllm.backends.attention import DecodeMetadata
    from pagedllm.backends.registry import BackendUnavailable, check_available, load_backend

    dtype = torch.bfloat16
    heads = kv_heads * group
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks, block, kv_heads, head, generator=gen).to(dtype).to(device)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq] + 1).view(batch, blocks_per_seq)
    tables = tables.to(torch.int32).to(device)
    query = torch.randn(batch, heads, head, generator=gen).to(dtype).to(device)
    meta = DecodeMetadata(tables, torch.full((batch,), context, dtype=torch.int32, device=device), context)
    scale = head**-0.5
    kv_bytes = 2 * batch * context * kv_heads * head * kv.element_size()

    # contiguous copies of each request's K/V for the dense baseline
    idx = tables.long()
    k_dense = kv[0][idx].reshape(batch, context, kv_heads, head).transpose(1, 2).contiguous()
    v_dense = kv[1][idx].reshape(batch, context, kv_heads, head).transpose(1, 2).contiguous()
    q4 = query.unsqueeze(2)  # [B, H, 1, D]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    reference = sdpa().squeeze(2).float()
    rows = []
    big = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(big)
    copy_s = timed(lambda: dst.copy_(big), device, repeats)
    copy_bw = 2 * big.numel() * big.element_size() / copy_s  # bytes read + written
    sdpa_s = timed(sdpa, device, repeats)
    rows.append(("torch SDPA, contiguous cache", sdpa_s, 0.0))
    failed: list[str] = []
    for name in backends:
        try:
            check_available(name)
        except BackendUnavailable as e:
            print(f"{name}: skipped ({e})")
            continue
        try:
            ops = load_backend(name)
        except Exception as e:  # noqa: BLE001 - reported as the row's failure
            print(f"{name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            failed.append(name)
            continue
        for label, config in variants(name, args.smoke):
            try:  # one backend or configuration failing (a build, a launch) must not hide the others
                if config is not None:
                    ops.decode_tile, ops.decode_warps = config
                out = ops.decode_attention(query, kv, meta, scale)
                err = (out.float() - reference).abs().max().item()
                seconds = timed(lambda ops=ops: ops.decode_attention(query, kv, meta, scale), device, repeats)
            except Exception as e:  # noqa: BLE001 - reported as the row's failure
                print(f"{label}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                failed.append(label)
                continue
            rows.append((label, seconds, err))
    print(
        f"batch {batch} x context {context}, head {head}, {heads} query / {kv_heads} KV heads, bfloat16, "
        f"block {block}; K/V read per call: {kv_bytes / 1e9:.3f} GB"
    )
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    print(f"{'kernel':40} {'time (us)':>10} {'KV GB/s':>9} {'of copy bw':>11} {'max err vs SDPA':>16}  check")
    for name, seconds, err in rows:
        bw = kv_bytes / seconds
        ok = math.isfinite(err) and err <= MAX_ERR  # NaN fails too
        if not ok:
            failed.append(name)
        print(
            f"{name:40} {seconds * 1e6:10.1f} {bw / 1e9:9.0f} {bw / copy_bw:10.0%} {err:16.2e}"
            f"  {'PASS' if ok else 'FAIL'}"
        )
    print(f"goal: paged decode >= 80% of the copy bandwidth; max error <= {MAX_ERR} (bfloat16)")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
