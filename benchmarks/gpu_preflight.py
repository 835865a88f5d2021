"""The GPU check's preflight: the versions of everything the CUDA backends need, and a clear
stop when something is missing.

    python -m pagedllm.benchmarks.gpu_preflight [1]     (1: smoke, no GPU required)
"""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys

NEEDED = ("torch", "triton", "transformers", "msgspec", "zmq", "safetensors")


def _tool(cmd: list[str], last_line: bool = False) -> str:
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        return lines[-1 if last_line else 0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "missing"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = bool(argv) and argv[0] == "1"
    print("python", platform.python_version())
    missing = []
    for name in NEEDED:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
            continue
        extra = f" (CUDA {mod.version.cuda}, GPUs: {mod.cuda.device_count()})" if name == "torch" else ""
        print(name, getattr(mod, "__version__", "?") + extra)
    from pagedllm.backends.cuda_native.build import find_nvcc

    print("nvcc", _tool([find_nvcc() or "nvcc", "--version"], last_line=True))
    print("ninja", _tool(["ninja", "--version"]))
    print("gcc", _tool(["gcc", "--version"]))
    print("driver", _tool(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]))
    if not smoke and "torch" not in " ".join(missing):
        import torch

        if not torch.cuda.is_available():
            missing.append("a CUDA device (torch.cuda.is_available() is False)")
    if missing:
        print("preflight: missing " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
