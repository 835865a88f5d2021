"""The CUDA backends on a machine without a GPU: the Triton kernels through Triton's
interpreter, the CUDA C++ sources through nvcc (compile only), and clear refusals. On a GPU
the full conformance suite runs for both."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.registry import BackendUnavailable, check_available, resolve_alias

HAS_GPU = torch.cuda.is_available()
CSRC = os.path.join(os.path.dirname(__file__), "..", "backends", "cuda_native", "csrc")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except ImportError:
        return False


def conformance(backend: str, *flags: str, env: dict | None = None, json_path=None):
    cmd = [sys.executable, "-m", "pagedllm.cli", "conformance", "--backend", backend, *flags]
    if json_path:
        cmd += ["--json", str(json_path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def _nvcc_usage():
    from pagedllm.backends.cuda_native.build import find_nvcc
    from pagedllm.benchmarks.kernel_registers import native_usage

    return None if find_nvcc() is None else native_usage("sm_90")


def _build_binding(folder):
    """binding.cpp compiled and linked against torch, the kernels stubbed: (the library, or None
    without a C++ compiler; the compiler's run)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX", "g++")
    if subprocess.run(["which", cxx], capture_output=True).returncode != 0:
        return None, None
    (folder / "stubs.cpp").write_text(LAUNCHER_STUBS)
    lib = folder / "binding.so"
    flags = [f"-I{p}" for p in include_paths()] + [f"-I{CSRC}"] + [f"-L{p}" for p in library_paths()]
    build = [cxx, "-std=c++17", "-O0", "-shared", "-fPIC", *flags, os.path.join(CSRC, "binding.cpp")]
    build += [str(folder / "stubs.cpp"), "-o", str(lib), "-lc10", "-ltorch_cpu"]
    return lib, subprocess.run(build, capture_output=True, text=True, timeout=300)


GPU_CHECK = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.sh")


def _gpu_check_smoke(out):
    bindir = os.path.dirname(sys.executable)  # the script calls python3: this environment's
    env = {**os.environ, "OUT": str(out), "PATH": bindir + os.pathsep + os.environ["PATH"]}
    return subprocess.run(["bash", GPU_CHECK, "--smoke"], capture_output=True, text=True, timeout=400, env=env)


@pytest.fixture(scope="module")
def background_runs(tmp_path_factory):
    """This module's long single-threaded runs — nvcc's kernels, g++'s torch binding,
    gpu_check.sh --smoke — started together in the background while the interpreter test runs
    (on 2 cores they overlap; each test then waits for its own)."""
    pool = concurrent.futures.ThreadPoolExecutor(3)
    runs = {"nvcc": pool.submit(_nvcc_usage), "binding": pool.submit(_build_binding, tmp_path_factory.mktemp("bind"))}
    smoke_out = tmp_path_factory.mktemp("gpu-check")
    runs["gpu_check"] = pool.submit(lambda: (smoke_out, _gpu_check_smoke(smoke_out)))
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_kernels_pass_the_op_checks_under_the_interpreter(tmp_path, background_runs):
    """The quick grid in float32 (long contexts and a batch of 96 included); the interpreter
    takes ~30 s a dtype here, so the 16-bit rows, chunked prefill (the prefill kernel after a
    cached prefix: multi_token_decode's long contexts check it here) and the real models'
    shapes are run by hand (README), and the sm_90 compilation is checked below."""
    checks = ["write_kv", "decode_attention", "prefill_attention", "large_scores", "sliding_window", "soft_cap"]
    checks += ["kv_cache", "multi_token_decode", "shared_blocks", "output_buffers", "argmax", "token_bitmask", "lora"]
    proc = conformance(
        "cuda-triton",
        "--ops-only",
        "--quick",
        "--dtype",
        "float32",
        *[flag for check in checks for flag in ("--only", check)],
        env={"TRITON_INTERPRET": "1"},
        json_path=tmp_path / "r.json",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    names = [c["check"] for c in report["checks"]]
    assert report["ok"] and {"decode_attention float32", "prefill_attention float32"} <= set(names)
    assert {"large_scores float32", "multi_token_decode float32", "lora float32"} <= set(names)
    assert not any("bfloat16" in n for n in names)
    assert all(c["cases"] > 0 for c in report["checks"])


# The whole engine on cuda-triton's kernels (interpreted) against the cpu backend's tokens:
# tests/test_worker_recovery.py::test_a_pool_in_device_memory_recovers_by_recompute.


def test_cuda_kernels_compile_with_nvcc_and_keep_the_attention_accumulators_in_registers(background_runs):
    """nvcc for sm_90 with ptxas' report: no warnings, and no paged-attention kernel (each dtype
    and GQA bound) has a stack frame or spills, which would put its inner loop in local memory."""
    result = background_runs["nvcc"].result()
    if result is None:
        pytest.skip("nvcc is not installed: the CUDA C++ kernels cannot be compile-checked here")
    usages, warnings = result
    assert not warnings, warnings
    attention = [u for u in usages if u.kernel.startswith("paged_attention_kernel")]
    assert len(attention) == 15, [u.kernel for u in usages]  # 3 dtypes x GQA bounds 1, 2, 4, 8, 16
    assert all(u.stack_bytes == 0 and u.spill_bytes == 0 for u in usages), usages


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_decode_default_config_compiles_for_sm90_without_spills():
    from pagedllm.backends.triton.ops import DECODE_TILE, DECODE_WARPS
    from pagedllm.benchmarks.kernel_registers import triton_decode_usage

    usage = triton_decode_usage(DECODE_TILE, DECODE_WARPS)
    assert usage.spill_bytes == 0 and usage.stack_bytes == 0 and usage.registers <= 128, usage


def test_triton_decode_config_comes_from_the_environment(monkeypatch):
    from pagedllm.backends.triton.ops import decode_config

    monkeypatch.setenv("PAGEDLLM_TRITON_DECODE_TILE", "128")
    monkeypatch.setenv("PAGEDLLM_TRITON_DECODE_WARPS", "4")
    assert decode_config(False) == (128, 4)
    monkeypatch.setenv("PAGEDLLM_TRITON_DECODE_TILE", "48")
    with pytest.raises(ValueError, match="PAGEDLLM_TRITON_DECODE_TILE must be a power of two"):
        decode_config(False)


LAUNCHER_STUBS = """
#include <stdexcept>
#include "kernels.h"
namespace pagedllm {
#define STUB(name, ...) const char* name(__VA_ARGS__) { throw std::runtime_error(#name " reached"); }
STUB(launch_write_kv, DType, const void*, const void*, void*, void*, const int64_t*, int, int, int, int, int64_t,
     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, void*)
STUB(launch_write_kv_codes, DType, KVCodes, const void*, const void*, void*, void*, float*, float*, const int64_t*,
     int, int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, void*)
STUB(launch_paged_attention, DType, void*, const void*, const void*, const void*, const int*, const int*,
     const int*, int, int, int, int, int, int, float, int, float, int64_t, int64_t, int64_t, int64_t, int64_t,
     int64_t, int64_t, int, int, float*, float*, float*, KVCodes, const float*, const float*, int64_t, int64_t,
     void*)
STUB(launch_reduce, DType, void*, const float*, const float*, const float*, int, int, int, int, int64_t, int64_t,
     void*)
STUB(launch_copy_blocks, DType, void*, const int64_t*, int, int, int64_t, int64_t, void*)
STUB(launch_add_lora, DType, void*, const void*, const void*, const void*, const int*, const float*, int, int, int,
     int, int64_t, int64_t, void*)
}
"""

LOAD_AND_CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
ops = torch.ops.pagedllm_native
print(ops.write_kv.default._schema)
print(ops.write_kv_codes.default._schema)
print(ops.add_lora.default._schema)
t = torch.zeros(2, 1, 4)
try:
    ops.write_kv(t, t, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(2, dtype=torch.int64), 0)
except RuntimeError as e:
    print("refused:", str(e).splitlines()[0])
"""


def test_torch_binding_builds_registers_its_operators_and_checks_devices(background_runs):
    """binding.cpp compiled and linked against torch (the kernels stubbed: no CUDA here), loaded
    as torch does it for cuda-native, its operators called with CPU tensors."""
    lib, proc = background_runs["binding"].result()
    if lib is None:
        pytest.skip(f"no C++ compiler ({os.environ.get('CXX', 'g++')})")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, str(lib)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagedllm_native::write_kv(Tensor" in proc.stdout and "pagedllm_native::write_kv_codes(Tensor" in proc.stdout
    assert "pagedllm_native::add_lora(Tensor" in proc.stdout
    assert "refused: cuda-native: key must be a CUDA tensor" in proc.stdout, proc.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_cuda_backends_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="cuda-native: no CUDA device"):
        check_available("cuda-native")
    with pytest.raises(BackendUnavailable, match=r"cuda-triton: .*no CUDA device"):
        check_available("cuda-triton")
    with pytest.raises(BackendUnavailable, match="cuda: no backend for it can run here"):
        resolve_alias("cuda")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "generate", "hi", "--backend", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda-triton", "cuda-native"])
def test_full_conformance_on_the_gpu(backend, tmp_path):
    proc = conformance(backend, json_path=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_cuda_alias_picks_a_backend_and_says_which():
    name, picked = resolve_alias("cuda")
    assert name in ("cuda-triton", "cuda-native") and name in picked


def test_gpu_check_runs_its_cpu_parts_in_smoke_mode(background_runs):
    """gpu_check.sh --smoke: the preflight and both benchmark scripts on tiny shapes on the CPU,
    one STEP line each and a summary, so a GPU session does not spend its minutes on a typo."""
    assert subprocess.run(["bash", "-n", GPU_CHECK]).returncode == 0
    tmp_path, proc = background_runs["gpu_check"].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = (tmp_path / "steps.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in steps] == ["STEP preflight", "STEP bandwidth", "STEP end-to-end"]
    assert all(": PASS in " in line for line in steps), steps
    assert "goal" in (tmp_path / "bandwidth.log").read_text() and "torch" in (tmp_path / "preflight.log").read_text()


def _compile_for_hopper(fn, pointer_types: dict, constexprs: dict):
    """Triton's full compile (to PTX and cubin) for an H100/H200, which needs no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    src = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_kernels_compile_for_hopper(dtype):
    """The interpreter does not check what the GPU compiler requires (dot shapes, types):
    compile each kernel for sm_90 as the engine would launch it."""
    from pagedllm.backends.triton import kernels as k

    p, fp32 = "*" + dtype, dtype == "fp32"
    for group, head in ((1, 64), (8, 128), (4, 80)):
        block_d = 1 << (head - 1).bit_length()
        common = {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "tables_ptr": "*i32", "out_ptr": p, "scale": "fp32"}
        common["soft_cap"] = "fp32"
        soft_cap = group == 4  # one shape compiles the soft-capped scores
        _compile_for_hopper(
            k.decode_kernel,
            {**common, "ctx_ptr": "*i32", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"},
            {
                "GROUP": group,
                "BLOCK_G": max(16, group),
                "HEAD_DIM": head,
                "BLOCK_D": block_d,
                "BLOCK_SIZE": 16,
                "TILE": 32,
                "PARTITION": 512,
                "SPLIT": True,
                "FP32": fp32,
                "SOFT_CAP": soft_cap,
                "KV_CODES": 0,
            },
        )
        _compile_for_hopper(
            k.prefill_kernel,
            {**common, "qsl_ptr": "*i32", "ctx_ptr": "*i32"},
            {
                "GROUP": group,
                "HEAD_DIM": head,
                "BLOCK_D": block_d,
                "BLOCK_SIZE": 16,
                "BLOCK_M": 32,
                "TILE": 32,
                "FP32": fp32,
                "SOFT_CAP": soft_cap,
                "KV_CODES": 0,
            },
        )
        _compile_for_hopper(
            k.decode_reduce_kernel,
            {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "out_ptr": p},
            {"HEAD_DIM": head, "BLOCK_D": block_d, "BLOCK_S": 8},
        )
    _compile_for_hopper(
        k.write_kv_kernel,
        {"key_ptr": p, "value_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_ptr": "*i64"},
        {"BLOCK_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128},
    )
    if fp32:  # 8-bit caches (the query in float32; bfloat16 queries take the same widened dots)
        scales = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_sb": "i64", "stride_ss": "i64"}
        codes = {**scales, "k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}
        for kv_codes in (1, 2, 3):
            _compile_for_hopper(
                k.write_kv_codes_kernel,
                {**codes, "key_ptr": p, "value_ptr": p, "slot_ptr": "*i64"},
                {"BLOCK_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "KV_CODES": kv_codes},
            )
        shape = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "TILE": 32, "FP32": True, "SOFT_CAP": False}
        _compile_for_hopper(
            k.decode_kernel,
            {**common, **codes, "ctx_ptr": "*i32", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32"}
            | {"part_sum_ptr": "*fp32"},
            {**shape, "GROUP": 4, "BLOCK_G": 16, "PARTITION": 512, "SPLIT": True, "KV_CODES": 2},
        )
        _compile_for_hopper(
            k.prefill_kernel,
            {**common, **codes, "qsl_ptr": "*i32", "ctx_ptr": "*i32"},
            {**shape, "GROUP": 4, "BLOCK_M": 32, "KV_CODES": 3},
        )
    _compile_for_hopper(
        k.copy_blocks_kernel,
        {"cache_ptr": p, "pairs_ptr": "*i64", "stride_layer": "i64"},
        {"BLOCK_ELEMS": 16 * 8 * 128, "CHUNK": 1024},
    )


PADDED_DECODE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.triton import TritonAttentionOps
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.backends.gpu.graphs import DecodeGraphs
from pagedllm.core.utils import cdiv
model = load_model(sys.argv[1], dtype="float32")
ops = TritonAttentionOps()
kv = allocate_kv_caches(model, 64, 16)
runner = ModelRunner(model, ops, kv, 16)
lens, tables, nxt = [5, 16, 40], [], 1
for n in lens:
    k = cdiv(n + 1, 16)
    tables.append(list(range(nxt, nxt + k)))
    nxt += k
runner.execute([SeqInput(list(range(3, 3 + n)), 0, t) for n, t in zip(lens, tables)])
decode = [SeqInput([7 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables))]
eager = runner.execute(decode)
runner.replay = DecodeGraphs(model, ops, kv, 16, max_batch=8, max_model_len=600)
assert runner.replay.fits(decode)
padded = runner.execute(decode)  # 3 decodes padded to the captured size 4
err = (eager - padded).abs().max().item()
assert err < 1e-4, err
assert not kv[:, :, 0].any(), "a padding row wrote into the null block"
# graphs cover contexts up to GRAPH_MAX_CONTEXT whatever max_model_len is; longer steps go eager
big = DecodeGraphs(model, ops, kv, 16, max_batch=8, max_model_len=131072)
assert big.max_context == 8192 and tuple(big.tables.shape) == (8, 512), big.tables.shape
assert big.fits([SeqInput([7], 8191, list(range(1, 513)))])
assert not big.fits([SeqInput([7], 8192, list(range(1, 514)))])
# a later step with shorter rows copies only the table columns it uses; the stale ones past
# each row's context are never read (the padded step above had them from capture-time zeros)
graphs = runner.replay
before = graphs.tables.clone()
assert graphs.stage([SeqInput([9], 1, tables[0][:1])]) == 1
assert graphs.tables[0, 0] == tables[0][0] and graphs.context_lens[0] == 2
assert graphs.tables[0, 1:].equal(before[0, 1:]) and graphs.tables[1:].equal(before[1:])
"""


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_decode_graph_padding_gives_the_eager_logits(tiny_model):
    """What a CUDA graph replays — static buffers, a batch padded to a captured size (padding
    rows write nowhere), partitions sized for the captured context bound, only the used table
    columns copied — run eagerly on the interpreted kernels, against the plain eager step."""
    proc = subprocess.run(
        [sys.executable, "-c", PADDED_DECODE, tiny_model("llama")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


EMPTY_PARTITIONS = """
import math, torch
real_empty = torch.empty
torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(math.nan)  # reused memory holding NaN
from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.triton.ops import TritonAttentionOps
g = torch.Generator().manual_seed(0)
kv = torch.randn(2, 81, 16, 1, 16, generator=g)
q = torch.randn(2, 2, 16, generator=g)
tables = torch.arange(1, 81, dtype=torch.int32).view(2, 40)
lens = torch.tensor([600, 10], dtype=torch.int32)  # 2 partitions of 512 for the first, 1 for the second
meta = DecodeMetadata(block_tables=tables, context_lens=lens, max_context_len=600)
torch.empty = real_empty
want = CpuAttentionOps().decode_attention(q, kv, meta, 0.25)
torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(math.nan)
got = TritonAttentionOps().decode_attention(q, kv, meta, 0.25)
assert torch.isfinite(got).all(), got
assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
print("ok")
"""


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_decode_ignores_partitions_past_a_short_rows_context():
    """A batch whose longest context spans several partitions and a short row: the short row's
    empty partitions must not reach its output through whatever their buffers held (NaN here)."""
    proc = subprocess.run(
        [sys.executable, "-c", EMPTY_PARTITIONS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_cuda_native_names_the_missing_build_tool_before_building(monkeypatch, tmp_path):
    """Each thing torch's extension builder needs is checked up front, so a GPU session gets a
    sentence instead of a traceback from the middle of a build."""
    from pagedllm.backends.cuda_native import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    assert build.missing_build_tools(None) is None  # everything is here
    version = build.nvcc_version(build.find_nvcc())
    other = f"{int(version.split('.')[0]) - 1}.8"
    reason = build.missing_build_tools(other)
    assert f"nvcc is CUDA {version}, torch was built for CUDA {other}" in reason
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in build.missing_build_tools(None)
    monkeypatch.delenv("CXX")
    real_which = build.shutil.which
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name == "ninja" else real_which(name))
    assert "no ninja" in build.missing_build_tools(None)
