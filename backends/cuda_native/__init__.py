"""The `cuda-native` backend: paged attention as CUDA C++ kernels built on first use."""

from .ops import NativeCudaAttentionOps

__all__ = ["NativeCudaAttentionOps"]
