"""Load a Hugging Face folder (config.json + safetensors, single or sharded) into CausalLM."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from pagedllm.core.model_folder import model_folder
from pagedllm.core.quantization import checkpoint_quantization, resolve_quantization

from .config import ModelConfig
from .decoder import CausalLM, RMSNorm
from .parallel import SINGLE, Shards, TensorParallel
from .quantized import QUANTIZED_PROJECTIONS, QuantizedLinear, QuantizedWeight, quantize_model
from .quantized_checkpoint import QUANTIZED_SUFFIXES, read_quantized
from .rope import RotaryEmbedding

# Hugging Face name pattern -> (our parameter, shard index within a fused matrix or None)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", None),
    "self_attn.q_norm": ("q_norm", None),
    "self_attn.k_norm": ("k_norm", None),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    "block_sparse_moe.gate": ("experts.router", None),  # Mixtral's router
    "mlp.gate": ("experts.router", None),  # Qwen3-MoE's
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", None),  # Gemma
    "post_feedforward_layernorm": ("post_feedforward_layernorm", None),
}
# our fused projection -> its Hugging Face parts, in shard order (q, k, v; gate, up)
_PARTS = {ours: [hf for hf, (p, _) in _LAYER_NAMES.items() if p == ours] for ours, _ in _LAYER_NAMES.values()}
_TOP_NAMES = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}
# Hugging Face projections saved fused (Phi-3) -> ours, and the Shards range of each part
_FUSED = {
    "self_attn.qkv_proj": ("qkv_proj", ("heads", "kv_heads", "kv_heads")),
    "mlp.gate_up_proj": ("gate_up_proj", ("intermediate", "intermediate")),
}
# an expert's projection (Mixtral's w1/w3/w2, Qwen3-MoE's names) -> (our stacked parameter, part)
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)$")
_EXPERT_PARTS = {
    "w1": ("w13", 0),
    "gate_proj": ("w13", 0),
    "w3": ("w13", 1),
    "up_proj": ("w13", 1),
    "w2": ("w2", None),
    "down_proj": ("w2", None),
}
# buffers some checkpoints carry that are recomputed here
# tensors a checkpoint may carry that the model does not use: rotary tables, and calibrated
# per-tensor KV cache scales (an 8-bit cache here has a scale per token and KV head, computed as
# it is written: finer than any per-tensor scale)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|self_attn\.(k_scale|v_scale|[kv]_proj\.output_scale)$")


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"model: no model.safetensors or model.safetensors.index.json in {model_dir!r}")


def _target(name: str) -> tuple[str, int | None] | None:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}", None
    m = _LAYER.match(stem)
    if m and m.group(2) in _LAYER_NAMES:
        param, shard = _LAYER_NAMES[m.group(2)]
        return f"layers.{m.group(1)}.{param}.{kind}", shard
    expert = _EXPERT.match(m.group(2)) if m and kind == "weight" else None
    if expert:  # one expert's slice of the stacked [experts, ...] parameter: (expert, part)
        param, part = _EXPERT_PARTS[expert.group(2)]
        return f"layers.{m.group(1)}.experts.{param}", (int(expert.group(1)), part)
    return None


def _materialize(model: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Storage for a model built on the meta device, floating point in `dtype` (what
    `to_empty(device).to(dtype)` does, without its empty_like over meta tensors, which imports
    sympy: a second of every worker's start). Shared tensors stay shared."""
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = real(t)


def load_model(
    model_dir: str,
    dtype: str | None = None,
    max_positions: int | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> CausalLM:
    """The model, or under tensor parallelism this rank's part of it: only its slices are read
    from the safetensors files, so no rank holds the whole model. `quantization`: a mode of
    core/quantization.py to apply as it loads; a checkpoint saved quantized (GPTQ, AWQ) loads
    as such whatever it says."""
    folder = model_folder(model_dir)
    cfg = ModelConfig.from_dict(folder.config, dtype)
    method = resolve_quantization(quantization, folder.config)
    saved = checkpoint_quantization(folder.config)
    if cfg.num_experts and saved:
        raise ValueError(f"quantization: a {saved[0]} checkpoint of a mixture-of-experts model is not supported yet")
    # the rotary tables are computed, not loaded: outside the meta device (where computing them
    # would pull in torch's meta kernels, a second and a half of every worker's start)
    positions = max(max_positions or 0, cfg.max_position_embeddings)
    rope_params = cfg.rope
    if rope_params["rope_type"] == "longrope":
        # one set of factors for the engine's life, as vLLM does: the long ones when contexts may
        # pass the pretraining length (transformers switches when a sequence does, recomputing it)
        longest = max_positions or cfg.max_position_embeddings
        rope_params = {**rope_params, "use_long": longest > rope_params["original_max_position_embeddings"]}
    rope = RotaryEmbedding(cfg.head_dim, rope_params, positions)
    local = cfg.local_rope
    local_rope = RotaryEmbedding(cfg.head_dim, local, positions) if local else None
    with torch.device("meta"):
        model = CausalLM(cfg, tp=tp, rope=rope, local_rope=local_rope)
        if saved is not None:  # no full-precision weights for the projections saved quantized
            for layer in model.layers:
                for name in QUANTIZED_PROJECTIONS:
                    setattr(layer, name, _BiasOnly(getattr(layer, name)))
    _materialize(model, device, cfg.dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = rope.to(device)
    model.local_rope = local_rope.to(device) if local_rope else None
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint stem -> its saved tensors
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors file is not iterable
                stem, _, suffix = name.rpartition(".")
                if saved is not None and suffix in QUANTIZED_SUFFIXES:
                    quantized.setdefault(stem, {})[suffix] = f.get_tensor(name)
                    continue
                fused = _fused_parts(f, name, model.shards, cfg, tp)
                if fused is not None:  # each part cut to this rank's share, then fused our way
                    param_name, parts = fused
                    for shard, tensor in enumerate(parts):
                        _copy_into(params[param_name], param_name, tensor, shard, model.shards, cfg, name)
                        loaded.add(f"{param_name}#{shard}")
                    continue
                target = _target(name)
                if (
                    saved is not None
                    and target
                    and target[0].endswith(".bias")
                    and target[0] not in params
                    and not f.get_tensor(name).any()
                ):
                    continue  # GPTQ saves a zero bias for every projection, whether the model has one or not
                if target is None or target[0] not in params:
                    if not _IGNORED.search(name):
                        unexpected.append(name)
                    continue
                param_name, shard = target
                tensor = _read_slice(f, name, model.shards, cfg, tp)
                _copy_into(params[param_name], param_name, tensor, shard, model.shards, cfg, name)
                loaded.add(f"{param_name}#{shard}")
    missing = [n for n, shards in _expected_loads(params, cfg) if not shards <= loaded]
    if saved is not None:
        missing += _install_quantized(model, quantized, *saved, cfg, tp, device)
        unexpected += [f"{stem}.{suffix}" for stem, tensors in quantized.items() for suffix in tensors]
    if missing or unexpected:
        raise ValueError(
            f"model: checkpoint in {model_dir!r} does not match {cfg.architecture}: "
            f"missing weights {missing or 'none'}; unexpected weights {unexpected or 'none'}"
        )
    if cfg.norm_offset:  # Gemma's norms scale by 1 + weight
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight += cfg.norm_offset
    if method is not None and saved is None:
        quantize_model(model, method, _ROW_PARALLEL)
    model.eval()
    return model


class _BiasOnly(torch.nn.Module):
    """A projection saved quantized, until its weights are read: only its bias, if any."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.bias = linear.bias


def _install_quantized(model, saved: dict, method: str, params: dict, cfg, tp, device) -> list[str]:
    """Build every layer's quantized projections from their saved tensors (taking them out of
    `saved`): each part read, cut to this rank's share (by whole groups) and fused. Returns the
    parts that are missing."""
    missing = []
    for i, layer in enumerate(model.layers):
        for name in QUANTIZED_PROJECTIONS:
            hf_names = _PARTS[name]
            parts = []
            for hf in hf_names:
                stem = f"model.layers.{i}.{hf}"
                if stem not in saved:
                    missing.append(f"{stem}.qweight")
                    continue
                weight = read_quantized(method, params, saved.pop(stem), stem)
                parts.append(_rank_share(weight, hf, model.shards, cfg, tp))
            if len(parts) == len(hf_names):
                weight = QuantizedWeight.stack(parts).to(device)
                setattr(layer, name, QuantizedLinear(weight, getattr(layer, name).bias))
    return missing


def _rank_share(weight: QuantizedWeight, hf: str, shards: Shards, cfg: ModelConfig, tp: TensorParallel):
    if tp.size == 1:
        return weight
    dim, what = SPLITS[hf]
    start, size = shard_range(what, shards, cfg)
    return weight.rows(start, size) if dim == 0 else weight.columns(start, size)


# HF weight (stem suffix) -> how it splits across ranks: (dimension, which Shards range);
# LoRA adapters (backends/lora.py) split as their base weights
SPLITS = {
    "self_attn.q_proj": (0, "heads"),
    "self_attn.k_proj": (0, "kv_heads"),
    "self_attn.v_proj": (0, "kv_heads"),
    "self_attn.o_proj": (1, "heads"),
    "mlp.gate_proj": (0, "intermediate"),
    "mlp.up_proj": (0, "intermediate"),
    "mlp.down_proj": (1, "intermediate"),
    "model.embed_tokens": (0, "vocab"),
    "lm_head": (0, "vocab"),
}
# our projections split by input channel (dimension 1) across ranks: o_proj, down_proj
_ROW_PARALLEL = frozenset(_LAYER_NAMES[hf][0] for hf, (dim, _) in SPLITS.items() if dim == 1)


def shard_range(kind: str, shards: Shards, cfg: ModelConfig) -> tuple[int, int]:
    """(start, size) of this rank's slice of a split dimension (a Shards range by name)."""
    d = cfg.head_dim
    return {
        "heads": (shards.head_start * d, shards.num_heads * d),
        "kv_heads": (shards.kv_head_start * d, shards.num_kv_heads * d),
        "intermediate": (shards.intermediate_start, shards.intermediate_size),
        "expert_intermediate": (shards.expert_intermediate_start, shards.expert_intermediate_size),
        "vocab": (shards.vocab_start, shards.vocab_rows),
    }[kind]


def _read_slice(f, name: str, shards: Shards, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of weight `name`. A row-parallel layer's bias is added once, by rank 0;
    rows past the vocabulary (its padding) are zeros."""
    stem, _, kind = name.rpartition(".")
    split = next((v for k, v in SPLITS.items() if stem == k or stem.endswith("." + k)), None)
    layer = _LAYER.match(stem)
    expert = _EXPERT.match(layer.group(2)) if layer else None
    if expert:  # every expert's slice of the intermediate dimension (models/moe.py)
        split = (1 if _EXPERT_PARTS[expert.group(2)][0] == "w2" else 0, "expert_intermediate")
    if tp.size == 1 or split is None:
        return f.get_tensor(name)
    dim, what = split
    view = f.get_slice(name)
    if kind == "bias" and dim == 1:
        tensor = view[:]
        return tensor if tp.is_first else torch.zeros_like(tensor)
    start, size = shard_range(what, shards, cfg)
    end = min(start + size, view.get_shape()[dim])
    part = view[start:end] if dim == 0 else view[:, start:end]
    if end - start < size:  # the vocabulary's padding
        part = torch.cat([part, part.new_zeros((size - (end - start), *part.shape[1:]))])
    return part


def _fused_parts(f, name: str, shards: Shards, cfg: ModelConfig, tp: TensorParallel):
    """(our parameter, this rank's part of each piece) for a weight saved fused, else None."""
    stem, _, kind = name.rpartition(".")
    m = _LAYER.match(stem)
    if not m or m.group(2) not in _FUSED or kind != "weight":
        return None
    ours, ranges = _FUSED[m.group(2)]
    whole = {"heads": cfg.num_heads * cfg.head_dim, "kv_heads": cfg.num_kv_heads * cfg.head_dim}
    whole["intermediate"] = cfg.intermediate_size
    tensor, parts, offset = f.get_tensor(name), [], 0
    for what in ranges:
        piece = tensor[offset : offset + whole[what]]
        offset += whole[what]
        start, size = shard_range(what, shards, cfg)
        parts.append(piece[start : start + size])
    return f"layers.{m.group(1)}.{ours}.weight", parts


def _shard_offsets(param_name: str, shards: Shards, cfg: ModelConfig) -> list[int]:
    if ".qkv_proj." in param_name:
        q, kv = shards.num_heads * cfg.head_dim, shards.num_kv_heads * cfg.head_dim
        return [0, q, q + kv, q + 2 * kv]
    if ".gate_up_proj." in param_name:
        return [0, shards.intermediate_size, 2 * shards.intermediate_size]
    raise AssertionError(param_name)


def _copy_into(
    param: torch.Tensor,
    param_name: str,
    tensor: torch.Tensor,
    shard: int | None,
    shards: Shards,
    cfg: ModelConfig,
    name: str,
) -> None:
    with torch.no_grad():
        if shard is None:
            dst = param
        elif isinstance(shard, tuple):  # (expert, part of its fused gate/up or None)
            expert, part = shard
            size = shards.expert_intermediate_size
            dst = param[expert] if part is None else param[expert, part * size : (part + 1) * size]
        else:
            offsets = _shard_offsets(param_name, shards, cfg)
            dst = param[offsets[shard] : offsets[shard + 1]]
        if dst.shape != tensor.shape:
            raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor.to(param.dtype))


def _expected_loads(params: dict, cfg: ModelConfig):
    for name in params:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith((".experts.w13", ".experts.w2")):
            parts = (0, 1) if name.endswith("w13") else (None,)
            yield name, {f"{name}#{(e, p)}" for e in range(cfg.num_experts) for p in parts}
            continue
        fused = ".qkv_proj." in name or ".gate_up_proj." in name
        shards = range(3 if ".qkv_proj." in name else 2) if fused else [None]
        yield name, {f"{name}#{s}" for s in shards}
