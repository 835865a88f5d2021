"""The model dtype on a GPU."""

from __future__ import annotations

from pagedllm.core.model_folder import model_folder


def default_dtype(model_dir: str, requested: str) -> str:
    """'auto' on a GPU: the checkpoint's 16-bit dtype, and bfloat16 for a float32 checkpoint."""
    if requested not in (None, "auto"):
        return requested
    saved = model_folder(model_dir).dtype
    return saved if saved in ("bfloat16", "float16") else "bfloat16"
