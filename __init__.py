"""pagedllm: PagedAttention and continuous batching over pluggable backends."""

# Absolute imports: pytest imports this file as the root package of the checkout, under the
# checkout folder's name, when it collects tests/.
from pagedllm.core.errors import InvalidParameter, RequestFailed
from pagedllm.core.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.core.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "InvalidParameter",
    "RequestFailed",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EngineDeadError",
    "__version__",
]


def __getattr__(name):
    # LLM pulls in the frontend (transformers); `import pagedllm.core` must stay light.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "EngineDeadError":
        from pagedllm.entrypoints.engine_client import EngineDeadError

        return EngineDeadError
    if name in ("RequestOutput", "CompletionOutput", "BeamSearchOutput", "BeamSearchSequence"):
        from pagedllm.entrypoints import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
