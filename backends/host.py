"""The host a process runs on, as figures are labelled with it: the CPU's model, the vector
units that decide how fast the CPU kernels run, and the cores this process may use."""

from __future__ import annotations

import os
import platform

# flags that decide how fast the CPU kernels run
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo; empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip() and fields:
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_info() -> dict:
    fields = cpuinfo_fields()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
