"""pagedllm: PagedAttention and continuous batching over pluggable backends."""

# Absolute imports: pytest imports this file as the root package of the checkout, under the
# checkout folder's name, when it collects tests/.
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "InvalidParameter", "__version__"]
