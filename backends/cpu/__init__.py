"""The `cpu` reference backend."""

from .ops import CpuAttentionOps

__all__ = ["CpuAttentionOps"]
