"""pagedllm: PagedAttention and continuous batching over pluggable backends."""

from .core.errors import InvalidParameter
from .core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "InvalidParameter", "__version__"]
