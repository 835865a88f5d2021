"""What pagedllm needs from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.core.model_folder import model_folder, rope_parameters

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention)
    # each layer's own rotary parameters where they differ from `rope` (Gemma 3's local layers)
    layer_ropes: tuple[dict | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma)
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + weight: added to the weights at load
    sandwich_norms: bool = False  # Gemma: the attention and MLP outputs normed before the residual add
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_soft_cap: float | None = None  # Gemma 2: attention scores soft-capped
    final_soft_cap: float | None = None  # Gemma 2: logits soft-capped
    # mixture of experts (Mixtral, Qwen3-MoE): which layers route, to how many of how many
    # experts of which size, the top-k weights renormalised or not
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    renormalize_top_k: bool = True
    dtype: torch.dtype = torch.float32
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (the KV cache manager can then free
        blocks that slid out of it), else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def local_rope(self) -> dict | None:
        """The rotary parameters of the layers that have their own (Gemma 3's local layers:
        one set for all of them), or None."""
        return next((r for r in self.layer_ropes if r), None)

    def attention_features(self) -> set[str]:
        """The optional attention features (AttentionOps.supports_*) this model needs."""
        needs = {"sliding_window"} if any(self.layer_windows) else set()
        return needs | ({"soft_cap"} if self.attn_soft_cap else set())

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
        gemma = arch in GEMMA
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"model: hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("model: use_bidirectional_attention is not supported (a decoder attends causally)")
        rope, layer_ropes = rope_parameters(cfg), ()
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"model: partial_rotary_factor {rope['partial_rotary_factor']} is not supported (1.0 only)"
            )
        if rope["rope_type"] == "longrope":  # Phi-3: its pretraining length, and the factor's default
            rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            rope.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        if isinstance(rope.get("full_attention"), dict):  # transformers 5's per-layer-type parameters (Gemma 3)
            by_type = {t: rope_parameters({"rope_parameters": p}) for t, p in rope.items() if isinstance(p, dict)}
            rope = by_type["full_attention"]
            types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
            layer_ropes = tuple(None if t == "full_attention" else by_type.get(t) for t in types)
        elif arch == "Gemma3ForCausalLM" and cfg.get("rope_local_base_freq"):  # transformers 4's Gemma 3
            local = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
            types = cfg.get("layer_types") or []
            layer_ropes = tuple(local if t == "sliding_attention" else None for t in types)
        scalar = cfg.get("query_pre_attn_scalar") if gemma else None
        moe = experts_config(cfg, arch)
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # Gemma ties unless it says not
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=rope,
            layer_windows=layer_windows(cfg, arch),
            layer_ropes=layer_ropes,
            hidden_act=act,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            attn_scale=scalar**-0.5 if scalar else None,
            attn_soft_cap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_soft_cap=cfg.get("final_logit_softcapping") if gemma else None,
            **moe,
            dtype=resolve_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype")),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
        )


def experts_config(cfg: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a Mixtral or Qwen3-MoE config (empty for
    dense models); a variant this MLP does not compute is refused, naming its field."""
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        num, size, renormalize, routed = cfg["num_local_experts"], cfg["intermediate_size"], True, [True] * layers
    elif arch == "Qwen3MoeForCausalLM":
        num = cfg.get("num_experts", cfg.get("num_local_experts"))  # the name transformers 5 writes
        size = cfg["moe_intermediate_size"]
        renormalize = bool(cfg.get("norm_topk_prob", False))
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        routed = [i not in dense and num > 0 and (i + 1) % step == 0 for i in range(layers)]
    else:
        return {}
    k = cfg["num_experts_per_tok"]
    if not 1 <= k <= num:
        raise ValueError(f"model: num_experts_per_tok must be between 1 and the {num} experts, got {k}")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("model: shared_expert_intermediate_size (shared experts) is not supported for " + arch)
    return dict(
        moe_layers=tuple(routed),
        num_experts=num,
        num_experts_per_tok=k,
        expert_intermediate_size=size,
        renormalize_top_k=renormalize,
    )


def layer_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: `layer_types` where the config
    lists them; otherwise Mistral's (and Mixtral's, Phi-3's) window on every layer, and Qwen2/Qwen3's
    (when use_sliding_window) on the layers from max_window_layers on."""
    num_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window"):
        window = None
    if not window:
        return (None,) * num_layers
    if window < 1 or int(window) != window:
        raise ValueError(f"model: sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"model: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                f"{num_layers} layers, got {types!r}"
            )
        return tuple(window if t == "sliding_attention" else None for t in types)
    first = cfg.get("max_window_layers", 0) if arch.startswith("Qwen") else 0
    return tuple(window if i >= first else None for i in range(num_layers))


def resolve_dtype(requested: str | None, from_config: str | None) -> torch.dtype:
    name = requested if requested not in (None, "auto") else (from_config or "float32")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; choose one of {', '.join(DTYPES)} or auto")
    return DTYPES[name]
