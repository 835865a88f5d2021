"""The support probe (`pagedllm conformance --support`): every feature the backend contract knows,
for every built-in backend (and any other installed one), as the backend answers for it — read
from its class, without its device — in the spirit of llama.cpp's support mode. One CSV row a
(backend, feature): whether it is supported, and how (its own kernel, the base class's torch
default, model code every backend runs). docs/backends.md is made from these rows and the
conformance runs at hand (conformance/matrix.py).
"""

from __future__ import annotations

import csv
import io

import torch

from pagedllm.backends.attention import AttentionOps
from pagedllm.backends.models.config import DTYPE_NAMES

COLUMNS = ("backend", "feature", "supported", "how")
KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")


def _own(cls, member: str) -> bool:
    return getattr(cls, member) is not getattr(AttentionOps, member)


def support_rows(name: str, cls) -> list[dict]:
    bare = cls.__new__(cls)  # answers from class attributes and kernel signatures

    def row(feature: str, supported: bool, how: str) -> dict:
        return {"backend": name, "feature": feature, "supported": "yes" if supported else "no", "how": how}

    rows = [
        row(f"dtype {DTYPE_NAMES[d]}", d in cls.supported_dtypes, "declared (supported_dtypes)")
        for d in (torch.float32, torch.bfloat16, torch.float16)
    ]
    for kv in KV_CACHE_DTYPES:
        why = bare.unsupported_kv_cache_dtype(kv, head_size=128)
        rows.append(row(f"kv cache {kv}", why is None, "declared, kernels take kv_scales" if why is None else why))
    for feature in ("sliding_window", "soft_cap"):
        rows.append(row(feature.replace("_", " "), bare.supports(feature), f"declared (supports_{feature})"))
    rows.append(row("mixture of experts", True, "model code (backends/models/moe.py) on the backend's ops"))
    rows.append(
        row(
            "token masks (structured outputs)",
            True,
            "own kernel" if _own(cls, "apply_token_bitmask") else "base class (torch)",
        )
    )
    rows.append(row("multi-token verification (speculation)", True, "the prefill kernel, one row per request"))
    quantized = "own kernel" if _own(cls, "quantized_linear") else "base class (dequantize, then torch)"
    rows += [row(f"{bits} weights", True, quantized) for bits in ("int8", "int4")]
    invariant = bool(getattr(cls, "batch_invariant", False))
    how = "declared (batch_invariant): the invariance rows hold it" if invariant else "not declared"
    if invariant and hasattr(cls, "batch_invariant_for") and not bare.batch_invariant_for(quantized=True):
        how += "; quantized weights with --batch-invariant"
    rows.append(row("batch invariance", invariant, how))
    rows.append(row("graph replay of decode steps", _own(cls, "capture_graphs"), "capture_graphs"))
    rows.append(row("KV pool survives a worker restart", bool(bare.kv_in_shared_memory), "kv_in_shared_memory"))
    return rows


def all_support_rows() -> list[dict]:
    """Every built-in backend's rows whose class imports here, then other installed ones'."""
    from pagedllm.backends.registry import available_backends, backend_class

    rows = []
    for name, _ in sorted(available_backends().items(), key=lambda item: not item[1].builtin):
        try:
            cls = backend_class(name)
        except Exception:  # noqa: BLE001 - a backend whose module cannot import here is left out
            continue
        rows += support_rows(name, cls)
    return rows


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
