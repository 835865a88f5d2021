"""Which weight quantization a model runs with: a mode applied at load time to a 16/32-bit
checkpoint, or the method of a checkpoint saved quantized (its config.json's
`quantization_config`). Torch-free: the frontend refuses a bad choice before anything starts.

Modes applied at load time (weight-only; activations, compute and the KV cache keep the
model dtype; the LM head and the embedding stay unquantized, as bitsandbytes and GPTQ leave them):
- int8: symmetric, one scale per output channel;
- int4: asymmetric, a scale and a zero point per group of 128 input channels (GPTQ's and
  AWQ's grouping, rounded to nearest);
- nf4: bitsandbytes' 4-bit NormalFloat, one absmax scale per block of 64 weights.

Checkpoint methods: gptq and awq, 4-bit (GPTQ's and AutoAWQ's GEMM packing).
"""

from __future__ import annotations

from .errors import InvalidParameter

ON_THE_FLY = ("int8", "int4", "nf4")
CHECKPOINT_METHODS = ("gptq", "awq")
QUANTIZATIONS = ON_THE_FLY + CHECKPOINT_METHODS


def checkpoint_quantization(config: dict) -> tuple[str, dict] | None:
    """(method, its parameters) for a checkpoint saved quantized; None for a plain one; a clear
    error for a method or variant that pagedllm cannot load."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise InvalidParameter(
            "quantization",
            f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which pagedllm cannot load "
            f"(it loads {' and '.join(CHECKPOINT_METHODS)} checkpoints; or quantize a 16/32-bit checkpoint "
            f"at load time with --quantization {'/'.join(ON_THE_FLY)})",
        )
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise InvalidParameter("quantization", f"{method} checkpoint with {bits}-bit weights: only 4-bit is supported")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise InvalidParameter("quantization", f"{method} checkpoint: group_size {group!r} is not a group size")
    params = {"bits": 4, "group_size": group}
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise InvalidParameter("quantization", f"gptq checkpoint_format {fmt!r}: only gptq and gptq_v2 load")
        params["zero_offset"] = 1 if fmt == "gptq" else 0  # v1 stores each zero point minus one
        if qc.get("lm_head"):
            raise InvalidParameter("quantization", "gptq checkpoint with a quantized lm_head: not supported")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise InvalidParameter("quantization", f"awq version {version!r}: only the GEMM packing loads")
        if not qc.get("zero_point", True):
            raise InvalidParameter("quantization", "awq checkpoint without zero points: not supported")
    return method, params


def resolve_quantization(requested: str | None, config: dict) -> str | None:
    """The quantization to run with: the checkpoint's own method, or the requested mode for a
    plain checkpoint. Asking for something else than a quantized checkpoint holds is an error."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise InvalidParameter("quantization", f"{requested!r} is not one of {', '.join(QUANTIZATIONS)}")
    saved = checkpoint_quantization(config)
    if saved is not None:
        method = saved[0]
        if requested not in (None, method):
            raise InvalidParameter(
                "quantization",
                f"the checkpoint is already quantized with {method}; --quantization {requested} cannot apply",
            )
        return method
    if requested in CHECKPOINT_METHODS:
        raise InvalidParameter(
            "quantization",
            f"{requested} needs a checkpoint saved by {requested} (a quantization_config in config.json); "
            f"this one has none. To quantize it at load time use {'/'.join(ON_THE_FLY)}",
        )
    return requested
