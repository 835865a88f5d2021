"""The cpu backend's ops against dense attention computed directly."""

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps, native
from pagedllm.backends.cpu.packed_linear import bfloat16_dot_products
from pagedllm.conformance.op_cases import context_lengths, make_case

OPS = CpuAttentionOps()
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=["compiled", "torch"])
def attention_path(request, monkeypatch):
    """float32 attention runs the compiled kernel where it builds; both paths are checked."""
    if request.param == "torch":
        monkeypatch.setattr(native, "unavailable_reason", lambda: "off for this test")
    elif native.unavailable_reason() is not None:
        pytest.skip(f"compiled kernel unavailable: {native.unavailable_reason()}")
    return request.param


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_attention(block_size, head_size, group, attention_path):
    ctx = context_lengths(block_size)
    case = make_case(
        [1] * len(ctx), ctx, block_size, head_size, num_kv_heads=2, group=group, seed=block_size * head_size + group
    )
    out = OPS.decode_attention(case.query, case.kv_cache, case.decode_metadata(), case.scale)
    assert (out.double() - case.expected).abs().max() <= ATOL[torch.float32]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_and_chunked_prefill_attention(block_size, head_size, group, attention_path):
    ctx = context_lengths(block_size)
    # whole prompts, then chunks that continue after a cached prefix
    q_lens = ctx + [1, max(1, block_size - 2), 3, 100]
    ctx = ctx + [block_size + 1, 2 * block_size, 1000, 1000]
    case = make_case(q_lens, ctx, block_size, head_size, num_kv_heads=2, group=group, seed=group)
    out = OPS.prefill_attention(case.query, case.kv_cache, case.prefill_metadata(), case.scale)
    assert (out.double() - case.expected).abs().max() <= ATOL[torch.float32]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_requests_sharing_blocks(phase, attention_path):
    q_lens = [1, 1, 1] if phase == "decode" else [5, 17, 1]
    case = make_case(q_lens, [40, 53, 33], block_size=16, head_size=64, num_kv_heads=2, group=4, share_prefix_blocks=2)
    assert (case.block_tables[:, :2] == case.block_tables[0, :2]).all()
    meta = case.decode_metadata() if phase == "decode" else case.prefill_metadata()
    op = OPS.decode_attention if phase == "decode" else OPS.prefill_attention
    out = op(case.query, case.kv_cache, meta, case.scale)
    assert (out.double() - case.expected).abs().max() <= ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_ops_within_tolerance(dtype, attention_path):
    case = make_case([1, 1, 7], [17, 300, 40], 16, 64, 2, 4, dtype=dtype)
    dec = make_case([1, 1], [17, 300], 16, 64, 2, 4, dtype=dtype)
    out = OPS.prefill_attention(case.query, case.kv_cache, case.prefill_metadata(), case.scale)
    assert out.dtype == dtype and (out.double() - case.expected).abs().max() <= ATOL[torch.bfloat16]
    out = OPS.decode_attention(dec.query, dec.kv_cache, dec.decode_metadata(), dec.scale)
    assert out.dtype == dtype and (out.double() - dec.expected).abs().max() <= ATOL[torch.bfloat16]


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [32, 64, 80, 128])
def test_16_bit_blocks_with_a_float32_query_are_float32_exact(dtype, head_size, float32_arithmetic):
    """How a 16-bit model runs on the kernels: float32 queries over 16-bit blocks. The blocks
    hold the case's values exactly, so only float32 arithmetic separates the result from the
    float64 reference: a widening that loses or misplaces any bit fails float32's tolerance."""
    case = make_case([1, 5, 17], [33, 300, 40], 16, head_size, 2, 4, dtype=dtype)
    query = case.query.float()
    out = OPS.prefill_attention(query, case.kv_cache, case.prefill_metadata(), case.scale)
    assert out.dtype == torch.float32 and (out.double() - case.expected).abs().max() <= ATOL[torch.float32]
    dec = make_case([1, 1, 1], [17, 300, 1], 16, head_size, 2, 4, dtype=dtype)
    out = OPS.decode_attention(dec.query.float(), dec.kv_cache, dec.decode_metadata(), dec.scale)
    assert (out.double() - dec.expected).abs().max() <= ATOL[torch.float32]


def poison_unused_slots(case) -> None:
    """NaN into every K/V slot that no request's context covers (what a pool may hold there)."""
    used = torch.zeros(case.kv_cache.shape[1:3], dtype=torch.bool)
    block_size = case.kv_cache.shape[2]
    for table, ctx in zip(case.block_tables.tolist(), case.context_lens):
        for t in range(ctx):
            used[table[t // block_size], t % block_size] = True
    case.kv_cache[:, ~used] = float("nan")


@pytest.mark.skipif(
    native.unavailable_reason() is not None or not native.bfloat16_dot_products(),
    reason="kernels not built for AVX-512 BF16",
)
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("block_size", [7, 16])
def test_bfloat16_dot_products_round_as_transformers_and_stay_within_the_context(head_size, block_size):
    """The AVX-512 BF16 path: the float32 query and the probabilities rounded to bfloat16, the
    products summed in float32. Against the float64 reference it errs by bfloat16's rounding of
    the probabilities (measured ~1.5e-3), far inside the conformance tolerance and far outside
    float32's (so the path did run); odd contexts and block sizes pair a last token with zero,
    never with the NaN a slot past the context may hold."""
    assert bfloat16_dot_products()
    q_lens, ctx = [1, 5, 17, 1], [33, 301, 41, 2 * block_size + 1]
    case = make_case(q_lens, ctx, block_size, head_size, 2, 4, dtype=torch.bfloat16, seed=head_size)
    poison_unused_slots(case)
    out = OPS.prefill_attention(case.query.float(), case.kv_cache, case.prefill_metadata(), case.scale)
    err = float((out.double() - case.expected).abs().max())
    assert ATOL[torch.float32] * 10 < err <= 5e-3, err
    dec = make_case([1] * len(ctx), ctx, block_size, head_size, 2, 4, dtype=torch.bfloat16, seed=head_size)
    poison_unused_slots(dec)
    out = OPS.decode_attention(dec.query.float(), dec.kv_cache, dec.decode_metadata(), dec.scale)
    err = float((out.double() - dec.expected).abs().max())
    assert ATOL[torch.float32] * 10 < err <= 5e-3, err


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_argmax_rows_answers_as_torch():
    """Ties (the first index), NaN (the first NaN), infinities, rows shorter than a vector and
    off its width, strided rows; and the ops' argmax is the kernel's."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 15, 16, 17, 100, 32000):
        x = torch.randn(8, n, generator=gen)
        x[1] = 0.0
        x[2, n // 2] = float("nan")
        x[3, n // 3] = x[3, n - 1] = 100.0
        x[4] = float("-inf")
        x[5, -1] = x[5, n // 4] = float("nan")
        x[6] = torch.randint(0, 3, (n,), generator=gen).float()
        x[7, -1] = float("inf")
        assert torch.equal(native.argmax_rows(x), x.argmax(-1)), n
        strided = torch.randn(3, n + 5, generator=gen)[:, 2 : n + 2]
        assert torch.equal(native.argmax_rows(strided), strided.argmax(-1)), n
    logits = torch.randn(64, 4096, generator=gen)
    assert torch.equal(OPS.argmax(logits), logits.argmax(-1))
    with pytest.raises(ValueError, match="2-D"):
        native.argmax_rows(torch.zeros(3))
    with pytest.raises(ValueError, match="float32"):
        native.argmax_rows(logits.bfloat16())


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_panel_linear_against_float64(dtype):
    """Shapes off every tile edge (rows not a multiple of 6, outputs not of the 16 of a panel,
    inputs over one 256-wide slice), with and without bias, against the float64 product of the
    same weights; and each row alone (the few-rows path a decode step takes) is the same bits as
    that row in the whole batch (the blocked path)."""
    gen = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 37, 64), (5, 8, 1000), (16, 100, 37), (67, 50, 1536), (3, 1, 7), (9, 33, 700)):
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen).to(dtype)
        for bias in (None, torch.randn(n, generator=gen)):
            expected = x.double() @ w.double().T + (0 if bias is None else bias.double())
            got = native.panel_linear(x, native.pack_panel_weight(w), n, bias)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert (got.double() - expected).abs().max() <= 1e-6 * k**0.5 * 10, (m, n, k)
            for r in {0, m - 1}:
                alone = native.panel_linear(x[r : r + 1], native.pack_panel_weight(w), n, bias)
                assert torch.equal(alone[0], got[r]), (m, n, k, r)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        native.pack_panel_weight(w.double())
    with pytest.raises(ValueError, match="pack_panel_weight"):
        native.panel_linear(x, w, n, None)
    with pytest.raises(ValueError, match="features"):
        native.panel_linear(x[:, :-1], native.pack_panel_weight(w), n, None)
    with pytest.raises(ValueError, match="panels"):
        native.panel_linear(x, native.pack_panel_weight(w), n + 16, None)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_panel_linear_widens_every_value_exactly(dtype):
    """x = identity: out = W^T exactly, for the extremes of each format (float16's subnormals,
    its largest value, bfloat16's smallest normals), through a padded panel (6 outputs of 16)."""
    info = torch.finfo(dtype)
    specials = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, info.tiny * info.eps, 0.0, -0.0, 1.0])
    k = 37
    w = torch.cat((specials, torch.randn(k * 6 - len(specials)))).view(6, k).to(dtype)
    out = native.panel_linear(torch.eye(k), native.pack_panel_weight(w), 6, None)
    assert torch.equal(out, w.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_touches_exactly_the_chosen_slots(dtype, attention_path):
    """K and V as the decoder hands them over: columns of the fused projection (each token's
    heads contiguous, rows strided), float32 activations into a pool of the model's dtype; the
    last slot included, and 300 tokens (the compiled copy's threaded size)."""
    for num_tokens, slots in ((5, [39, 4, 5, 22, 9]), (300, torch.randperm(400)[:300].tolist())):
        kv = torch.zeros(2, 100, 4, 2, 8, dtype=dtype)
        qkv = torch.randn(num_tokens, 64)  # four query heads, two KV heads of 8
        key, value = qkv[:, 32:48].view(num_tokens, 2, 8), qkv[:, 48:].view(num_tokens, 2, 8)
        slots = torch.tensor(slots)
        OPS.write_kv(key, value, kv, slots)
        flat_k, flat_v = kv[0].view(-1, 2, 8), kv[1].view(-1, 2, 8)
        assert torch.equal(flat_k[slots], key.to(dtype)) and torch.equal(flat_v[slots], value.to(dtype))
        others = torch.ones(400, dtype=torch.bool)
        others[slots] = False
        assert not flat_k[others].any() and not flat_v[others].any()


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_compiled_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing():
    kv = torch.zeros(2, 10, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    with pytest.raises(IndexError, match=r"1 slot\(s\) outside the cache's 40 slots"):
        native.write_kv(key, key, kv, torch.tensor([3, 40, 5]))
    assert not kv.any()
    with pytest.raises(ValueError, match="rows of the cache's dtype"):
        native.write_kv(key.bfloat16(), key.bfloat16(), kv, torch.tensor([3, 4, 5]))


def test_copy_and_swap_blocks():
    caches = torch.randn(3, 2, 6, 4, 2, 8)
    before = caches.clone()
    OPS.copy_blocks(caches, [(1, 4), (2, 5)])
    assert torch.equal(caches[:, :, 4], before[:, :, 1]) and torch.equal(caches[:, :, 5], before[:, :, 2])
    assert torch.equal(caches[:, :, :4], before[:, :, :4])
    host = torch.zeros(3, 2, 3, 4, 2, 8)
    OPS.swap_blocks(caches, host, [(3, 0), (1, 2)])
    assert torch.equal(host[:, :, 0], caches[:, :, 3]) and torch.equal(host[:, :, 2], caches[:, :, 1])
    assert not host[:, :, 1].any()


def test_compiled_kernels_are_built_at_install_and_can_be_turned_off(tmp_path):
    """The machines this project runs on have g++: installing the package builds the kernels for
    this machine (setup.py), and the backend loads that library rather than compiling on first
    use. Off with PAGEDLLM_CPU_KERNELS=0; a compiler that fails (so no prebuilt library matches
    its key) leaves the torch path and a reason naming the source."""
    from pagedllm.backends.cpu import kernel_build

    assert native.unavailable_reason() is None
    name = kernel_build.library_name(kernel_build.compiler())
    assert os.path.exists(os.path.join(kernel_build.PREBUILT, name)), (
        "the cpu kernels were not built at install: `pip install -e .` builds them (again after csrc/ changes)"
    )
    assert native._library()._name == os.path.join(kernel_build.PREBUILT, name)
    probe = "from pagedllm.backends.cpu import native; print(native.unavailable_reason())"

    def reason(**env):
        done = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PAGEDLLM_CACHE": str(tmp_path), **env},
        )
        return done.stdout.strip()

    assert reason(PAGEDLLM_CPU_KERNELS="0") == "PAGEDLLM_CPU_KERNELS=0"
    failed = reason(CXX="false", PAGEDLLM_CACHE=str(tmp_path / "other"))
    assert failed.startswith(
        "building kernels.cpp, panel_linear.cpp, quantized_linear.cpp, step_program.cpp: false failed"
    ), failed


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_fused_rms_norm_and_silu_and_mul_match_torch():
    from pagedllm.backends.models.decoder import RMSNorm, silu_and_mul

    gen = torch.Generator().manual_seed(0)
    for rows, size in ((1, 64), (7, 256), (300, 704), (3, 37)):  # below and above the threading cut-off; a tail
        x = torch.randn(rows, size, generator=gen) * 3
        norm = RMSNorm(size, 1e-6)
        norm.weight.data = torch.randn(size, generator=gen)
        torch.testing.assert_close(native.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)
        gate_up = torch.cat((torch.linspace(-100, 100, rows * size).view(rows, size), x), dim=1)
        torch.testing.assert_close(native.silu_and_mul(gate_up), silu_and_mul(gate_up), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        native.silu_and_mul(x.bfloat16())


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_fused_residual_add_and_rms_norm_match_torch():
    """The residual connection and the next norm in one pass: the residual stream becomes the
    sum in place, and the norm of the sum is what RMSNorm(x + residual) gives."""
    from pagedllm.backends.cpu.model_kernels import FusedRMSNorm
    from pagedllm.backends.models.decoder import RMSNorm

    gen = torch.Generator().manual_seed(1)
    for rows, size in ((1, 64), (7, 256), (300, 704), (3, 37)):
        norm = RMSNorm(size, 1e-6)
        norm.weight.data = torch.randn(size, generator=gen)
        x, residual = torch.randn(rows, size, generator=gen), torch.randn(rows, size, generator=gen) * 3
        want, want_sum = norm(x, residual.clone())
        stream = residual.clone()
        got, got_sum = FusedRMSNorm(norm)(x, stream)
        assert got_sum is stream and torch.equal(stream, residual + x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)
    with pytest.raises(ValueError, match="residual must be a contiguous float32"):
        native.add_rms_norm(x, residual.t(), norm.weight, 1e-6)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_the_bfloat16_replays_kernels_are_the_float32_ones_with_torchs_roundings():
    """A replayed bfloat16 step (step_replay._onednn_calls) reads GEMM products in bfloat16
    and writes the next GEMM's rows in bfloat16: each kernel must give exactly the float32
    kernel's answer on the widened input, rounded as torch rounds it (to nearest, ties to
    even) — on any CPU, whichever steps replay there."""
    from pagedllm.backends.models.rope import RotaryEmbedding

    lib, threads, bf16 = native._library(), torch.get_num_threads(), torch.bfloat16
    x16, out16 = native.MIXED_X_BF16, native.MIXED_OUT_BF16
    gen = torch.Generator().manual_seed(3)
    for rows, size in ((1, 256), (33, 256), (70, 704), (3, 37)):  # rows of both sides of the threading threshold
        weight, x = torch.randn(size, generator=gen), torch.randn(rows, size, generator=gen).to(bf16)
        residual = torch.randn(rows, size, generator=gen) * 3
        for formats in (x16, x16 | out16):
            want_stream = residual.clone()
            want = native.add_rms_norm(x.float(), want_stream, weight, 1e-5)
            stream, out = residual.clone(), torch.empty(rows, size, dtype=bf16 if formats & out16 else torch.float32)
            args = (x.data_ptr(), stream.data_ptr(), weight.data_ptr(), 1e-5, out.data_ptr(), rows, size, formats)
            lib.pagedllm_add_rms_norm_mixed(*args, threads)
            assert torch.equal(stream, want_stream) and torch.equal(out, want.to(out.dtype))
        out = torch.empty(rows, size, dtype=bf16)
        lib.pagedllm_rms_norm_mixed(
            residual.data_ptr(), weight.data_ptr(), 1e-5, out.data_ptr(), rows, size, out16, threads
        )
        assert torch.equal(out, native.rms_norm(residual, weight, 1e-5).to(bf16))
        gate_up, act = torch.randn(rows, 2 * size, generator=gen).mul(4).to(bf16), torch.empty(rows, size, dtype=bf16)
        lib.pagedllm_silu_and_mul_mixed(gate_up.data_ptr(), act.data_ptr(), rows, size, x16 | out16, threads)
        assert torch.equal(act, native.silu_and_mul(gate_up.float()).to(bf16))
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 10000.0}, 512)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 511, 17, 3]), torch.float32)
    qkv = torch.randn(5, 8 * 64, generator=gen).to(bf16)  # 4 query heads, then 2 K and 2 V heads
    want = native.rotate(qkv.float()[:, : 6 * 64].view(5, 6, 64), cos, sin)
    q, k = torch.empty(5, 4, 64), torch.empty(5, 2, 64, dtype=bf16)
    lib.pagedllm_rotary_mixed(qkv.data_ptr(), 8 * 64, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), 5, 4, 64, x16, 1)
    k_in = qkv.data_ptr() + 4 * 64 * 2
    lib.pagedllm_rotary_mixed(k_in, 8 * 64, cos.data_ptr(), sin.data_ptr(), k.data_ptr(), 5, 2, 64, x16 | out16, 1)
    assert torch.equal(q, want[:, :4]) and torch.equal(k, want[:, 4:].to(bf16))


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
def test_fused_rotary_matches_torch():
    """On the strided q/k columns of a fused projection, as the decoder hands them over."""
    from pagedllm.backends.models.rope import RotaryEmbedding, rotate

    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 10000.0}, 512)
    positions = torch.tensor([0, 5, 511, 17, 3])
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(5, (4 + 2 * 2) * 64)
    qk = qkv[:, : 6 * 64].view(5, 6, 64)
    torch.testing.assert_close(native.rotate(qk, cos, sin), rotate(qk, cos, sin), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="heads contiguous"):
        native.rotate(qk.transpose(0, 1), cos, sin)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_prepare_model_puts_each_dtype_on_its_kernels(tiny_model, dtype):
    from torch import nn

    from pagedllm.backends.cpu.model_kernels import (
        Bfloat16Linear,
        Float32Embedding,
        FusedRMSNorm,
        PanelLinear,
        panel_float32_linear,
    )
    from pagedllm.backends.cpu.packed_linear import PackedLinear, native_bfloat16_matmul, packing_available
    from pagedllm.backends.models.loader import load_model

    model = load_model(tiny_model("llama"), dtype)
    CpuAttentionOps().prepare_model(model)
    assert isinstance(model.norm, FusedRMSNorm) and model.norm.weight.dtype == torch.float32
    assert all(layer.act is native.silu_and_mul and layer.rotate is native.rotate for layer in model.layers)
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear, PanelLinear, Bfloat16Linear))]
    if dtype == "float32":
        # the panel kernel on CPUs with AVX2 and FMA, oneDNN's packed GEMM elsewhere
        if panel_float32_linear():
            want = PanelLinear
        else:
            want = PackedLinear if packing_available(torch.float32) else nn.Linear
        assert linears and all(type(m) is want for m in linears)
    else:
        # 16-bit weights read in place (bfloat16 ones by oneDNN where the CPU multiplies
        # bfloat16), activations in float32
        on_onednn = dtype == "bfloat16" and native_bfloat16_matmul()
        want = Bfloat16Linear if on_onednn else PanelLinear
        assert linears and all(type(m) is want and m.packed.dtype == getattr(torch, dtype) for m in linears)
        assert isinstance(model.embed_tokens, Float32Embedding)
        assert model.embed_tokens(torch.tensor([1, 2])).dtype == torch.float32


def test_device_host_swaps_copy_runs_of_blocks_straight_into_their_slots():
    """The path a device backend's swaps take (pool and swap space on different devices),
    run here on host tensors: runs of consecutive blocks, one copy per layer, K/V and run."""
    from pagedllm.backends.attention import block_runs, copy_block_runs

    assert block_runs([(3, 0), (4, 1), (5, 2), (9, 3), (10, 7), (11, 8)]) == [(3, 0, 3), (9, 3, 1), (10, 7, 2)]
    pool = torch.randn(3, 2, 12, 4, 2, 8)
    swap = torch.zeros(3, 2, 9, 4, 2, 8)
    pairs = [(3, 0), (4, 1), (5, 2), (9, 3), (10, 7), (11, 8)]
    copy_block_runs(pool, swap, pairs)
    for s, d in pairs:
        assert torch.equal(swap[:, :, d], pool[:, :, s])
    assert not swap[:, :, 4:7].any()
    back = torch.zeros_like(pool)
    copy_block_runs(swap, back, [(d, s) for s, d in pairs])
    assert torch.equal(back[:, :, [3, 4, 5, 9, 10, 11]], pool[:, :, [3, 4, 5, 9, 10, 11]])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [64, 80])  # read in place; widened first
def test_every_8bit_code_reads_as_torch_reads_it_and_writes_round_as_torch(kv_dtype, head_size):
    """Attention over a one-token context returns that token's V: with every code of the format
    in V (the non-finite aside) and a scale of 1, the compiled kernel's widening must give torch's value
    for each. And the compiled write_kv must store the codes and scales kv_cache.quantize does."""
    from pagedllm.backends.kv_cache import KV_CODE_DTYPES, allocate_pool, layer_caches, quantize

    if native.unavailable_reason():
        pytest.skip(native.unavailable_reason())
    code_dtype = KV_CODE_DTYPES[kv_dtype]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code_dtype)
    codes = codes[codes.float().isfinite()]  # write_kv never stores e5m2's infinities or a NaN
    rows = -(-len(codes) // head_size)
    padded = torch.zeros(rows * head_size, dtype=torch.uint8).view(code_dtype)
    padded[: len(codes)] = codes
    pool = allocate_pool(kv_dtype, 1, rows + 7, 1, 1, head_size, torch.float32)
    cache, scales = layer_caches(pool, kv_dtype, 1, 1, head_size)[0]
    cache[1, 1 : rows + 1, 0, 0] = padded.view(rows, head_size)
    scales[:, 1:] = 1.0
    tables = torch.arange(1, rows + 1, dtype=torch.int32).view(rows, 1)
    meta = DecodeMetadata(tables, torch.ones(rows, dtype=torch.int32), 1)
    out = CpuAttentionOps().decode_attention(torch.randn(rows, 1, head_size), cache, meta, 1.0, kv_scales=scales)
    assert torch.equal(out.flatten(), padded.float())
    # writes: rows spanning the formats' ranges, a zero row, subnormal-sized values
    x = torch.randn(6, 1, head_size) * torch.tensor([1e-3, 1.0, 300.0, 1e4, 0.0, 1e-30]).view(6, 1, 1)
    slots = torch.arange(rows + 1, rows + 7)  # blocks of one slot
    CpuAttentionOps().write_kv(x, x, cache, slots, kv_scales=scales)
    want_codes, want_scales = quantize(x, code_dtype)
    got = cache[0].reshape(-1, 1, head_size)[slots]
    assert torch.equal(got.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales[0].reshape(-1, 1)[slots], want_scales)
