"""Where pagedllm keeps what it makes on first use (the fallback demo model, compiled kernels)."""

from __future__ import annotations

import os


def cache_root(*parts: str) -> str:
    """~/.cache/pagedllm (or $PAGEDLLM_CACHE, or $XDG_CACHE_HOME/pagedllm) joined with parts,
    created if missing."""
    root = os.environ.get("PAGEDLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm"
    )
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path
