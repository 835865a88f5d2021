"""Builds the cuda-native extension on first use with torch's C++/CUDA extension builder and
caches it under ~/.cache/pagedllm (or $PAGEDLLM_CACHE), keyed by the sources and torch version."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sysconfig

from pagedllm.core.cache_dir import cache_root

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("binding.cpp", "kernels.cu")
HEADERS = ("kernels.h", "kernels.cuh")


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME / CUDA_PATH, then PATH, then /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_version(nvcc: str) -> str | None:
    """'12.4' from `nvcc --version`, or None if it does not say."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def missing_build_tools(torch_cuda: str | None) -> str | None:
    """What the first build would stop on, said before it starts: nvcc, its CUDA headers, a C++
    compiler, ninja, Python's headers, and an nvcc whose CUDA major version is torch's (a newer
    system nvcc links a second CUDA runtime, which needs a newer driver). None when all is there."""
    nvcc = find_nvcc()
    if nvcc is None:
        return "no CUDA compiler (nvcc) to build its kernels: install the CUDA toolkit or set CUDA_HOME"
    cuda_home = os.path.dirname(os.path.dirname(nvcc))
    if not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime.h")):
        return f"no CUDA headers (cuda_runtime.h) under {cuda_home}/include: install the CUDA toolkit's headers"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) for the extension: install g++ or set CXX"
    if shutil.which("ninja") is None:
        return "no ninja, which torch's extension builder needs: pip install ninja"
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers (Python.h): install this Python's development package"
    version = nvcc_version(nvcc)
    major = torch_cuda.split(".")[0] if torch_cuda else None
    if major and version and version.split(".")[0] != major:
        return f"nvcc is CUDA {version}, torch was built for CUDA {torch_cuda}: point CUDA_HOME at a {major}.x toolkit"
    return None


def _fingerprint() -> str:
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def load_extension():
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("cuda-native: no CUDA compiler found (nvcc): install the CUDA toolkit or set CUDA_HOME")
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    import torch
    from torch.utils.cpp_extension import load

    key = _fingerprint()
    build_dir = cache_root("cuda_native", key)
    load(
        name=f"pagedllm_cuda_native_{key}",
        sources=[os.path.join(CSRC, s) for s in SOURCES],
        extra_include_paths=[CSRC],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math"],
        build_directory=build_dir,
        is_python_module=False,  # binding.cpp registers torch operators
        verbose=os.environ.get("PAGEDLLM_BUILD_VERBOSE") == "1",
    )
    return torch.ops.pagedllm_native


def nvcc_compile_only(out_dir: str, arch: str = "sm_90") -> list[str]:
    """The nvcc command that compiles the kernels alone (no torch headers), for checks on
    machines without a GPU."""
    return [
        find_nvcc() or "nvcc",
        "-std=c++17",
        "-O3",
        "-c",
        os.path.join(CSRC, "kernels.cu"),
        "-o",
        os.path.join(out_dir, "kernels.o"),
        "-gencode",
        f"arch=compute_{arch[3:]},code={arch}",
    ]
