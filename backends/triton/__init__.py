"""The `cuda-triton` backend: paged attention as Triton kernels."""

from .ops import TritonAttentionOps

__all__ = ["TritonAttentionOps"]
