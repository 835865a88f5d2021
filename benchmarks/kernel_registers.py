"""Registers, stack and spills of the CUDA kernels for a GPU architecture, from ptxas, on any
machine with nvcc (cuda-native) and triton (cuda-triton's decode kernel): no GPU needed.

    python -m pagedllm.benchmarks.kernel_registers [--arch sm_90]

A kernel with a stack frame or spills in its inner loop reads local memory there; the
attention kernels should show neither.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

# decode_kernel configurations to report: (tile of context positions, num_warps)
TRITON_CONFIGS = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8)]


@dataclass
class KernelUsage:
    kernel: str
    registers: int
    stack_bytes: int
    spill_bytes: int  # stores + loads


def parse_ptxas(text: str) -> list[KernelUsage]:
    """ptxas -v's report, one entry per compiled function, names demangled where c++filt is."""
    usages, name, stack, spill = [], None, 0, 0
    for line in text.splitlines():
        if found := re.search(r"Compiling entry function '(\w+)'", line):
            name = _demangle(found.group(1))
        elif found := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stack, spill = int(found.group(1)), int(found.group(2)) + int(found.group(3))
        elif (found := re.search(r"Used (\d+) registers", line)) and name:
            usages.append(KernelUsage(name, int(found.group(1)), stack, spill))
            name = None
    return usages


def _demangle(symbol: str) -> str:
    try:
        name = subprocess.run(["c++filt", symbol], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return symbol
    return re.sub(r"pagedllm::kernels::|\(.*", "", name).removeprefix("void ")


def native_usage(arch: str = "sm_90") -> tuple[list[KernelUsage], list[str]]:
    """cuda-native's kernels compiled by nvcc for `arch`, and the compiler's warning lines."""
    from pagedllm.backends.cuda_native.build import nvcc_compile_only

    with tempfile.TemporaryDirectory() as out:
        cmd = nvcc_compile_only(out, arch) + ["-Xptxas", "-v"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stderr[-3000:]}")
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line.lower()]
    return parse_ptxas(proc.stderr), warnings


def triton_decode_usage(tile: int, warps: int, group: int = 8, head_size: int = 128) -> KernelUsage:
    """cuda-triton's decode kernel for bfloat16, block size 16, compiled for sm_90a with the
    16-divisibility the JIT infers for pointers and strides of such shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.backends.triton import kernels

    fn = kernels.decode_kernel
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16"}
    pointers |= {"tables_ptr": "*i32", "ctx_ptr": "*i32", "part_acc_ptr": "*fp32"}
    pointers |= {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    ints = ["stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_bt", "stride_os", "stride_oh"]
    ints += ["num_heads", "num_splits", "window", "stride_sb", "stride_ss"]
    constants = dict(GROUP=group, BLOCK_G=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=head_size)
    constants |= dict(BLOCK_D=head_size, BLOCK_SIZE=16, TILE=tile, PARTITION=512, SPLIT=True, FP32=False)
    constants |= dict(SOFT_CAP=False, KV_CODES=0)
    floats = {"scale": "fp32", "soft_cap": "fp32"}
    signature = {**pointers, **floats, **{n: "i32" for n in ints}, **{n: "constexpr" for n in constants}}
    divisible = [
        *pointers,
        *(n for n in ints if n not in ("stride_bt", "num_splits", "window", "stride_sb", "stride_ss")),
    ]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as out:
        ptx = os.path.join(out, "decode.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        proc = subprocess.run(
            [_triton_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(out, "decode.o")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{proc.stderr[-3000:]}")
    (usage,) = parse_ptxas(proc.stderr)
    usage.kernel = f"decode_kernel tile {tile} x {warps} warps"
    return usage


def _triton_ptxas() -> str:
    """The ptxas Triton ships that reads the PTX version it writes (triton 3.9: ptxas-blackwell)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.access(os.path.join(bin_dir, name), os.X_OK):
            return os.path.join(bin_dir, name)
    raise RuntimeError(f"no ptxas under {bin_dir}")


def format_usage(title: str, usages: list[KernelUsage]) -> str:
    lines = [title, f"{'kernel':48} {'registers':>9} {'stack B':>8} {'spill B':>8}"]
    lines += [f"{u.kernel:48} {u.registers:9} {u.stack_bytes:8} {u.spill_bytes:8}" for u in usages]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="cuda-native's target (default sm_90); Triton's is sm_90a")
    args = ap.parse_args(argv)
    usages, warnings = native_usage(args.arch)
    print(format_usage(f"cuda-native, nvcc for {args.arch}", usages))
    print("\n".join(warnings))
    print()
    rows = [triton_decode_usage(tile, warps) for tile, warps in TRITON_CONFIGS]
    print(format_usage("cuda-triton decode, bfloat16, head 128, GQA 8, for sm_90a", rows))


if __name__ == "__main__":
    main()
