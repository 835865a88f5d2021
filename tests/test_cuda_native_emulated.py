"""The cuda-native kernels run on the CPU: kernels.cu and kernels.cuh compiled by g++ against
tests/cuda_emulation (a std::thread per CUDA thread, barriers for __syncthreads and warp
shuffles; `kernel<<<...>>>(...)` rewritten into an emulated launch), called through the real
launchers, and compared with the conformance suite's float64 reference. No GPU needed: this is
where the kernels' indexing, vector loads, GQA bounds, partitions and reduction are checked
before a GPU ever runs them."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch

from pagedllm.conformance.op_cases import make_case

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "backends", "cuda_native", "csrc")
EMULATION = os.path.join(HERE, "cuda_emulation")
PARTITION = 512  # the backend's context partition (backends/cuda_native/ops.py)
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # kernels.h DType

SHIM = """
extern "C" const char* emulated_attention(int dtype, void* out, const void* query, const void* k_cache,
    const void* v_cache, const int* tables, const int* row_request, const int* row_position, int rows,
    int num_heads, int kv_heads, int head_size, int block_size, int max_blocks, float scale, int window,
    float soft_cap, int64_t qsr, int64_t qsh, int64_t osr, int64_t osh, int64_t csb, int64_t css, int64_t csh,
    int partition_size, int partitions, float* part_out, float* part_max, float* part_sum, int codes,
    const float* k_scales, const float* v_scales, int64_t ssb, int64_t sss) {
  using namespace pagedllm;
  const char* e = launch_paged_attention(static_cast<DType>(dtype), out, query, k_cache, v_cache, tables,
      row_request, row_position, rows, num_heads, kv_heads, head_size, block_size, max_blocks, scale, window,
      soft_cap, qsr, qsh,
      osr, osh, csb, css, csh, partition_size, partitions, part_out, part_max, part_sum, static_cast<KVCodes>(codes),
      k_scales, v_scales, ssb, sss, nullptr);
  if (e || partitions == 1) return e;
  return launch_reduce(static_cast<DType>(dtype), out, part_out, part_max, part_sum, rows, num_heads, head_size,
                       partitions, osr, osh, nullptr);
}

extern "C" const char* emulated_write_codes(int dtype, int codes, const void* key, const void* value, void* k_cache,
    void* v_cache, float* k_scales, float* v_scales, const int64_t* slots, int tokens, int kv_heads, int head_size,
    int block_size, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh, int64_t csb, int64_t css, int64_t csh,
    int64_t ssb, int64_t sss) {
  using namespace pagedllm;
  return launch_write_kv_codes(static_cast<DType>(dtype), static_cast<KVCodes>(codes), key, value, k_cache,
      v_cache, k_scales, v_scales, slots, tokens, kv_heads, head_size, block_size, kst, ksh, vst, vsh, csb, css, csh,
      ssb, sss, nullptr);
}

extern "C" const char* emulated_add_lora(int dtype, void* out, const void* x, const void* a, const void* b,
    const int* slots, const float* scales, int rows, int width_in, int width_out, int rank, int64_t osr, int64_t xsr) {
  using namespace pagedllm;
  return launch_add_lora(static_cast<DType>(dtype), out, x, a, b, slots, scales, rows, width_in, width_out, rank,
                         osr, xsr, nullptr);
}
"""


def emulated_source() -> str:
    """kernels.cu with each `kernel<<<grid, block, smem, stream>>>(args)` turned into
    `::emu::launch(grid, block, smem, stream, kernel, args)`."""
    with open(os.path.join(CSRC, "kernels.cu")) as f:
        source = f.read()
    source, launches = re.subn(r"([\w:]+(?:<[^<>;]*>)?)<<<([^;]*?)>>>\(", r"::emu::launch(\2, \1, ", source)
    assert launches == 6, f"expected the six kernel launches of kernels.cu, rewrote {launches}"
    return source + SHIM


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    build = tmp_path_factory.mktemp("cuda_emulation")
    (build / "emulated.cpp").write_text(emulated_source())
    lib = build / "emulated.so"
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{EMULATION}", f"-I{CSRC}"]
    proc = subprocess.run([*cmd, str(build / "emulated.cpp"), "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lib = ctypes.CDLL(str(lib))
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.emulated_attention.restype = lib.emulated_write_codes.restype = ctypes.c_char_p
    attention = [i32, *[ptr] * 7, *[i32] * 6, ctypes.c_float, i32, ctypes.c_float, *[i64] * 7, i32, i32]
    lib.emulated_attention.argtypes = [*attention, *[ptr] * 3, i32, ptr, ptr, i64, i64]
    lib.emulated_write_codes.argtypes = [i32, i32, *[ptr] * 7, *[i32] * 4, *[i64] * 9]
    lib.emulated_add_lora.restype = ctypes.c_char_p
    lib.emulated_add_lora.argtypes = [i32, *[ptr] * 6, *[i32] * 4, i64, i64]
    return lib


@pytest.fixture(scope="module")
def library(emulated):
    return emulated.emulated_attention


def run_attention(fn, case, rows_request, rows_position, partitions, kv_scales=None):
    """The binding's call (binding.cpp paged_attention), on CPU tensors; part_out starts as NaN,
    as reused device memory can be. kv_scales: case.kv_cache holds 8-bit codes."""
    q, kv = case.query, case.kv_cache
    rows, heads, head_size = q.shape
    k_cache, v_cache = kv[0], kv[1]
    codes = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}.get(k_cache.dtype, 0)
    scales = (None, None, 0, 0)
    if kv_scales is not None:
        scales = (kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), kv_scales.stride(1), kv_scales.stride(2))
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((rows, heads, partitions, head_size), float("nan"))
    part_max = torch.full((rows, heads, partitions), float("nan"))
    part_sum = torch.full_like(part_max, float("nan"))
    tables = case.block_tables.contiguous()
    request = torch.tensor(rows_request, dtype=torch.int32)
    position = torch.tensor(rows_position, dtype=torch.int32)
    error = fn(
        DTYPES[q.dtype],
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        request.data_ptr(),
        position.data_ptr(),
        rows,
        heads,
        k_cache.shape[2],
        head_size,
        k_cache.shape[1],
        tables.shape[1],
        case.scale,
        case.window or 0,
        case.soft_cap or 0.0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        PARTITION,
        partitions,
        part_out.data_ptr(),
        part_max.data_ptr(),
        part_sum.data_ptr(),
        codes,
        *scales,
    )
    assert error is None, error
    return out


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

DECODE_CASES = [
    # dtype, head size, query heads per KV head, contexts (one row each)
    pytest.param(torch.bfloat16, 128, 8, [1, 17, 700, 1300], id="bf16-head128-gqa8-partitions"),
    pytest.param(torch.float32, 80, 3, [5, 530], id="fp32-head80-gqa3-below-its-bound"),
    pytest.param(torch.float16, 256, 16, [300, 530], id="fp16-head256-gqa16"),
    pytest.param(torch.bfloat16, 64, 1, [2, 513], id="bf16-head64-mha"),
    pytest.param(torch.float32, 256, 5, [129, 640], id="fp32-head256-gqa5"),
]


@pytest.mark.parametrize("dtype,head_size,group,contexts", DECODE_CASES)
def test_decode_matches_the_reference(library, dtype, head_size, group, contexts):
    """One query per request at its last position; contexts past one partition split and reduce,
    and a shorter row in the same batch leaves empty partitions whose output is NaN garbage."""
    case = make_case([1] * len(contexts), contexts, 16, head_size, 2, group, dtype=dtype, seed=head_size + group)
    partitions = -(-max(contexts) // PARTITION)
    out = run_attention(library, case, list(range(len(contexts))), [c - 1 for c in contexts], partitions)
    assert torch.isfinite(out.float()).all(), "non-finite output"
    err = (out.double() - case.expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e}"


def test_windows_and_soft_caps_in_decode_and_prefill(library):
    """A window that empties whole partitions (decode past 1,300 positions, window 600) and
    starts inside a block; a window shorter than a chunk in prefill; soft-capped scores."""
    contexts = [1, 40, 700, 1300]
    case = make_case([1] * 4, contexts, 16, 64, 2, 4, dtype=torch.bfloat16, seed=3, window=600, soft_cap=5.0)
    out = run_attention(library, case, list(range(4)), [c - 1 for c in contexts], -(-1300 // PARTITION))
    assert (out.double() - case.expected).abs().max().item() <= TOLERANCE[torch.bfloat16]
    query_lens, contexts = [12, 8], [142, 8]
    case = make_case(query_lens, contexts, 16, 128, 2, 2, seed=8, window=37, soft_cap=50.0)
    request = [r for r, n in enumerate(query_lens) for _ in range(n)]
    position = [p for n, c in zip(query_lens, contexts) for p in range(c - n, c)]
    out = run_attention(library, case, request, position, 1)
    assert (out.double() - case.expected).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype,head_size,group", [(torch.bfloat16, 96, 4), (torch.float32, 128, 2)])
def test_prefill_rows_attend_causally_over_the_cached_prefix(library, dtype, head_size, group):
    """A chunked prefill: 12 new tokens after 130 cached (two chunks of 128 positions), and a fresh
    8-token prompt; each row is one query token attending to positions 0..its own (partitions
    == 1, as in prefill)."""
    query_lens, contexts = [12, 8], [142, 8]
    case = make_case(query_lens, contexts, 16, head_size, 2, group, dtype=dtype, seed=7)
    request = [r for r, n in enumerate(query_lens) for _ in range(n)]
    position = [p for n, c in zip(query_lens, contexts) for p in range(c - n, c)]
    out = run_attention(library, case, request, position, 1)
    err = (out.double() - case.expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e}"


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_8bit_caches_write_as_torch_and_attend_over_codes_times_scales(emulated, kv_dtype):
    """write_kv_codes stores torch's codes and scales (kv_cache.quantize), bit for bit, for
    bfloat16 keys spanning 1e-30..1e4; attention over those codes, a bfloat16 query, decode past a
    partition and a prefill chunk at positions past 512 (one partition: the whole context),
    equals float64 attention over code * scale."""
    from pagedllm.backends.kv_cache import allocate_pool, dequantize, layer_caches, write_quantized
    from pagedllm.conformance.op_cases import PagedCase, dense_attention

    bs, kv_heads, head_size, group = 16, 2, 64, 4
    contexts = [3, 700]
    blocks = [-(-c // bs) for c in contexts]
    pool = allocate_pool(kv_dtype, 1, 1 + sum(blocks), bs, kv_heads, head_size, torch.bfloat16)
    cache, scales = layer_caches(pool, kv_dtype, bs, kv_heads, head_size)[0]
    reference = pool.clone()
    ref_cache, ref_scales = layer_caches(reference, kv_dtype, bs, kv_heads, head_size)[0]
    gen = torch.Generator().manual_seed(5)
    tokens = sum(contexts)
    magnitude = torch.logspace(-30, 4, tokens).view(tokens, 1, 1)
    key = (torch.randn(tokens, kv_heads, head_size, generator=gen) * magnitude).bfloat16()
    value = torch.randn(tokens, kv_heads, head_size, generator=gen).bfloat16()
    slots = torch.arange(bs, bs + tokens)  # request 0 in block 1, request 1 from block 2
    slots[contexts[0] :] += bs - contexts[0]
    error = emulated.emulated_write_codes(
        DTYPES[torch.bfloat16],
        {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}[kv_dtype],
        key.data_ptr(),
        value.data_ptr(),
        cache[0].data_ptr(),
        cache[1].data_ptr(),
        scales[0].data_ptr(),
        scales[1].data_ptr(),
        slots.data_ptr(),
        tokens,
        kv_heads,
        head_size,
        bs,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        scales.stride(1),
        scales.stride(2),
    )
    assert error is None, error
    write_quantized(key, value, ref_cache, ref_scales, slots)
    assert torch.equal(pool, reference)
    held = dequantize(cache, scales).view(2, -1, kv_heads, head_size)
    tables = torch.tensor([[1] + [0] * (blocks[1] - 1), list(range(2, 2 + blocks[1]))], dtype=torch.int32)
    query = (torch.randn(2 + 9, kv_heads * group, head_size, generator=gen) / magnitude.max() ** 0.5).bfloat16()
    # decode: a row at each request's last position; then a chunk of 9 new tokens of request 1
    request = [0, 1] + [1] * 9
    position = [contexts[0] - 1, contexts[1] - 1] + list(range(contexts[1] - 9, contexts[1]))
    expected = []
    for row, (r, p) in enumerate(zip(request, position)):
        rows = slots[sum(contexts[:r]) : sum(contexts[:r]) + p + 1]
        expected.append(dense_attention(query[row : row + 1].float(), held[0][rows], held[1][rows], 0.125))
    case = PagedCase(cache, query[:2], [1] * 11, [p + 1 for p in position], tables, torch.cat(expected), 0.125)
    decode = run_attention(emulated.emulated_attention, case, request[:2], position[:2], 2, scales)
    case.query = query[2:]
    chunk = run_attention(emulated.emulated_attention, case, request[2:], position[2:], 1, scales)
    out = torch.cat([decode[:2], chunk]).double()
    assert (out - case.expected).abs().max().item() <= TOLERANCE[torch.bfloat16] * case.expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_adds_each_rows_adapter_and_leaves_rows_without_one(emulated, dtype):
    """Four adapters of rank 24 (not a multiple of the four warps' stride), rows of each and of
    none mixed; out's rows strided (a view of a wider buffer, as a fused projection's slice is)."""
    gen = torch.Generator().manual_seed(3)
    rows, width_in, width_out, rank = 11, 70, 45, 24
    a = (torch.randn(4, rank, width_in, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(4, width_out, rank, generator=gen) * 0.1).to(dtype)
    scales = torch.tensor([2.0, 0.5, 1.0, 0.25])
    slots = torch.tensor([3, 3, -1, 0, 1, 2, -1, 2, 0, 1, 3], dtype=torch.int32)
    x = torch.randn(rows, width_in, generator=gen).to(dtype)
    wide = torch.randn(rows, width_out + 7, generator=gen).to(dtype)
    before = wide.clone()
    out = wide[:, 3 : 3 + width_out]
    want = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T * scales[s].item()
    error = emulated.emulated_add_lora(
        DTYPES[dtype],
        out.data_ptr(),
        x.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        slots.data_ptr(),
        scales.data_ptr(),
        rows,
        width_in,
        width_out,
        rank,
        out.stride(0),
        x.stride(0),
    )
    assert error is None, error
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype] * 2
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + width_out :], before[:, 3 + width_out :])
    assert torch.equal(wide[2], before[2]) and torch.equal(wide[6], before[6])  # the rows without an adapter
