"""LoRA adapters as users name them (`LoRARequest`, vLLM's shape) and as PEFT saves them: a
folder with adapter_config.json and adapter_model.safetensors. `read_adapter` checks a folder
against the base model before any weight is loaded, and says what is wrong with it; it reads
only the JSON config and the safetensors header (no torch).

What is served: LoRA (`peft_type` "LORA") on the attention and MLP projections of a decoder
(q/k/v/o_proj, gate/up/down_proj), one rank for every module, scaling lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora), no bias, no other trained modules (`modules_to_save`),
no DoRA."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

import msgspec

from .errors import InvalidParameter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MODULE = re.compile(r"(?:^|\.)(\w+)\.lora_[AB]\.weight$")


class LoRARequest(msgspec.Struct, frozen=True):
    """An adapter for a request: its name (the OpenAI `model`), a positive id unique to it, and
    its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what the worker loads, and what keys its prefix-cache blocks."""

    name: str
    id: int
    path: str
    rank: int
    scale: float
    modules: tuple[str, ...]  # of TARGETS, in that order
    tensors: dict  # safetensors key -> (layer, module, "A" | "B")


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a decoder's config.json, per layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config.get("intermediate_size", 0)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_request(lora: LoRARequest) -> None:
    if not lora.lora_name:
        raise InvalidParameter("lora_request", "lora_name must not be empty")
    if lora.lora_int_id < 1:
        raise InvalidParameter("lora_request", f"lora_int_id must be >= 1, got {lora.lora_int_id}")


def read_adapter(lora: LoRARequest, model_config: dict, max_lora_rank: int) -> AdapterSpec:
    """The adapter at lora.lora_path, checked against the base model's config.json; an
    InvalidParameter naming the adapter and what is wrong otherwise."""
    check_request(lora)

    def refuse(message: str):
        return InvalidParameter("lora_request", f"adapter {lora.lora_name!r} ({lora.lora_path}): {message}")

    config_path = os.path.join(lora.lora_path, CONFIG_FILE)
    weights_path = os.path.join(lora.lora_path, WEIGHTS_FILE)
    if not os.path.isdir(lora.lora_path):
        raise refuse("no such folder")
    if not os.path.isfile(config_path):
        raise refuse(f"no {CONFIG_FILE} in it")
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(lora.lora_path, "adapter_model.bin"))
        raise refuse(
            f"no {WEIGHTS_FILE} in it" + (" (adapter_model.bin is not read: save with safetensors)" if pickled else "")
        )
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise refuse(f"{CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above max_lora_rank {max_lora_rank}")
    for field, why in (
        ("modules_to_save", "trains other modules than the projections"),
        ("rank_pattern", "gives modules ranks of their own"),
        ("alpha_pattern", "gives modules alphas of their own"),
        ("use_dora", "is a DoRA adapter"),
        ("fan_in_fan_out", "stores its weights transposed (Conv1D models)"),
    ):
        if cfg.get(field):
            raise refuse(f"{field}: the adapter {why}, which is not served")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"bias {cfg['bias']!r}: only adapters without bias terms are served")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # (a string is a regular expression: the tensors below say what it matched)
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
        if unknown:
            raise refuse(f"target module {unknown[0]!r} is not served (served: {', '.join(TARGETS)})")
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_header(weights_path, refuse)
    shapes = module_shapes(model_config)
    layers = model_config["num_hidden_layers"]
    moe = bool(model_config.get("num_local_experts") or model_config.get("num_experts"))
    found: dict = {}
    for key, header in tensors.items():
        named = _MODULE.search(key)
        if named is None:
            raise refuse(f"tensor {key!r} is not a LoRA weight (lora_A or lora_B)")
        if named.group(1) not in TARGETS:
            raise refuse(f"target module {named.group(1)!r} is not served (served: {', '.join(TARGETS)})")
        match = _KEY.search(key)
        if match is None:
            raise refuse(f"tensor {key!r} is not in a decoder layer's attention or MLP")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if moe and module in ("gate_proj", "up_proj", "down_proj"):
            raise refuse(f"{module}: LoRA on a mixture of experts' MLP is not served")
        if layer >= layers:
            raise refuse(f"tensor {key!r}: the base model has {layers} layers")
        width_in, width_out = shapes[module]
        want = [rank, width_in] if side == "A" else [width_out, rank]
        if header.get("shape") != want:
            raise refuse(f"tensor {key!r} has shape {header.get('shape')}, the base model needs {want}")
        found[key] = (layer, module, side)
    modules = tuple(m for m in TARGETS if any(v[1] == m for v in found.values()))
    if not modules:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    for layer, module in {(v[0], v[1]) for v in found.values()}:
        if {v[2] for v in found.values() if v[:2] == (layer, module)} != {"A", "B"}:
            raise refuse(f"layer {layer} {module}: lora_A and lora_B must both be saved")
    return AdapterSpec(lora.lora_name, lora.lora_int_id, lora.lora_path, rank, scale, modules, found)


def _read_header(path: str, refuse) -> dict:
    """The safetensors header: tensor name -> {"dtype", "shape", "data_offsets"}."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise refuse(f"{WEIGHTS_FILE} is not a safetensors file ({e})") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise refuse(f"{WEIGHTS_FILE} is not a safetensors file (its header is not a map of tensors)")
    header.pop("__metadata__", None)
    return header
