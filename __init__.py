"""pagedllm: PagedAttention and continuous batching over pluggable backends."""

# Absolute imports: pytest imports this file as the root package of the checkout, under the
# checkout folder's name, when it collects tests/. Every name loads on first use: the engine's
# processes import their own modules, not the user API's.

from pagedllm.core.version import VERSION as __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "LoRARequest",
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
    if name in ("InvalidParameter", "RequestFailed"):
        from pagedllm.core import errors

        return getattr(errors, name)
    if name in ("SamplingParams", "BeamSearchParams"):
        from pagedllm.core import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from pagedllm.core.lora import LoRARequest

        return LoRARequest
    if name == "StructuredOutputsParams":
        from pagedllm.core.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
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
