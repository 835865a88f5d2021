"""The eager forward pass, recorded: the steps the step replay binds, in the order the model
runs them (as a CUDA graph is captured from the eager pass, not written beside it).

`record_forward` runs the model once over one token with hooks on its norms and linear
layers, the decoder layers' rotation and activation wrapped, and attention ops that record
instead of computing (the KV pool is not touched). Every torch call the pass makes outside
those steps is watched: a view or a split passes, anything that computes (a scale, an add
outside the fused norms, a soft cap) makes the pass one the replay does not reproduce, and
nothing is recorded. So whatever the eager forward does, the replay does the same steps in
the same order, or the model runs eagerly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from ..attention import AttentionMetadata, DecodeMetadata
from ..models.decoder import CausalLM, DecoderLayer
from .model_kernels import FusedRMSNorm, PanelLinear
from .packed_linear import PackedLinear
from .quantized_linear import CpuQuantizedLinear

# the linear layers recorded as steps: the panel kernel's, oneDNN's packed GEMMs (bfloat16
# on CPUs that multiply bfloat16, float32 where the panel kernel is not used), and weight-only
# quantized layers (their GEMV, or oneDNN's GEMM on the decoded weights)
RECORDED_LINEARS = (PanelLinear, PackedLinear, CpuQuantizedLinear)

# torch calls the eager pass makes between its steps that move no number: shapes and views
VIEW_CALLS = frozenset(
    {"view", "reshape", "split", "chunk", "__getitem__", "size", "dim", "__get__", "unsqueeze", "__len__"}
)


class Step(NamedTuple):
    """One step of the eager forward pass."""

    kind: str  # "norm", "linear", "lora" (the adapters' products after it), "rotate", "write_kv", "attend" or "act"
    index: int  # the decoder layer's index (its KV cache); -1 after the last layer
    layer: DecoderLayer | None
    module: object = None  # the norm or linear layer (lora: backends/lora.py's LoRAProjection)
    residual: bool = False  # a norm that adds the residual stream to its input
    options: tuple = ()  # attention: the keywords the layer passed (window, soft_cap, KV scales)


class _Watch(TorchFunctionMode):
    """Notes the torch calls made outside the recorded steps that are not views."""

    def __init__(self, depth: list[int], stray: list[str]):
        super().__init__()
        self.depth, self.stray = depth, stray

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.depth[0] and getattr(func, "__name__", str(func)) not in VIEW_CALLS:
            self.stray.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _RecordingOps:
    """Attention ops that record the call and return zeros of the output's shape."""

    def __init__(self, record, depth: list[int]):
        self.record, self.depth = record, depth

    def write_kv(self, key, value, kv_cache, slot_mapping, **options):
        self.record("write_kv", options=tuple(sorted(options)))

    def decode_attention(self, query, kv_cache, meta, scale, **options):
        self.record("attend", options=tuple(sorted(options)))
        self.depth[0] += 1
        try:
            return torch.zeros_like(query)
        finally:
            self.depth[0] -= 1

    prefill_attention = decode_attention


def record_forward(model: CausalLM, kv_caches) -> list[Step] | None:
    """The steps of the model's eager forward pass, or None where it computes outside them."""
    steps: list[Step] = []
    depth, stray, at = [0], [], [-1, None]  # at: the layer running (index, layer)

    def record(kind, module=None, residual=False, options=()):
        steps.append(Step(kind, at[0], at[1], module, residual, options))

    def enter(*_):
        depth[0] += 1

    def leave(module, args, _output, kind):
        depth[0] -= 1
        if kind is not None:
            residual = kind == "norm" and len(args) > 1 and args[1] is not None
            record(kind, module, residual)

    def wrap(fn, kind):
        def wrapped(*args, **kwargs):
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if kind is not None:
                    record(kind)

        return wrapped

    def layer_starts(index, layer):
        def hook(*_):
            at[0], at[1] = index, layer

        return hook

    from ..lora import LoRAProjection

    handles, saved = [], []
    try:
        for module in model.modules():
            if isinstance(module, FusedRMSNorm):
                kind = "norm"
            elif isinstance(module, RECORDED_LINEARS):
                kind = "linear"
            elif isinstance(module, LoRAProjection):
                kind = "lora"  # its base layer's step comes first
            elif module is model.embed_tokens:
                kind = None  # the replay looks the embedding up itself
            else:
                continue
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(lambda m, a, o, k=kind: leave(m, a, o, k)))
        for index, layer in enumerate(model.layers):
            handles.append(layer.register_forward_pre_hook(layer_starts(index, layer)))
            saved.append((layer, layer.rotate, layer.act))
            layer.rotate, layer.act = wrap(layer.rotate, "rotate"), wrap(layer.act, "act")
        handles.append(model.norm.register_forward_pre_hook(layer_starts(-1, None)))
        rope_cos_sin = model.rope.cos_sin
        model.rope.cos_sin = wrap(rope_cos_sin, None)  # the replay looks the rotary rows up itself
        one = torch.zeros(1, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=one,
            num_decode_tokens=1,
            num_prefill_tokens=0,
            decode=DecodeMetadata(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1),
            prefill=None,
        )
        with torch.inference_mode(), _Watch(depth, stray):
            model(one, one, kv_caches, meta, _RecordingOps(record, depth))
    finally:
        for handle in handles:
            handle.remove()
        for layer, rotate, act in saved:
            layer.rotate, layer.act = rotate, act
        model.rope.__dict__.pop("cos_sin", None)
    return None if stray else steps
