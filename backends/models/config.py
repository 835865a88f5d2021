"""What pagedllm needs from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.core.model_folder import model_folder, rope_parameters

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta and the type's parameters
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype: str | None = None) -> ModelConfig:
        return cls.from_dict(model_folder(model_dir).config, dtype)

    @classmethod
    def from_dict(cls, cfg: dict, dtype: str | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        if arch == "Qwen3ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=rope_parameters(cfg),
            sliding_window=sliding,
            dtype=resolve_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype")),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
        )


def resolve_dtype(requested: str | None, from_config: str | None) -> torch.dtype:
    name = requested if requested not in (None, "auto") else (from_config or "float32")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; choose one of {', '.join(DTYPES)} or auto")
    return DTYPES[name]
