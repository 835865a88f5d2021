"""Small Hugging Face model folders with random weights, made by transformers itself.

Each is a real `save_pretrained` folder (config.json, model.safetensors, tokenizer files with a
chat template) so that pagedllm's loader and transformers load exactly the same thing. The
tokenizer is a byte-level BPE trained on a fixed text, so every string round-trips and
multi-byte characters can split across tokens.
"""

from __future__ import annotations

import functools
import os

import torch

ARCHITECTURES = ("llama", "llama3-rope", "mistral", "qwen2", "qwen3")

_TEXT = """\
The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in
fixed-size blocks, and a block table maps each sequence to its blocks. Continuous batching
lets requests join and leave the running batch at every step. A scheduler decides which
tokens run; a worker computes them. Naïve café façade — déjà vu, über, 東京, 😀 emoji.
def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_config(arch: str, vocab_size: int, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    elif arch == "llama3-rope":  # llama3 rope scaling and tied embeddings
        cfg = tf.LlamaConfig(
            **{**common, "tie_word_embeddings": True},
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None, head_dim=16)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHITECTURES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_model_dir(
    path: str,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 400,
    model_vocab_size: int | None = None,
    **config_overrides,
) -> str:
    """Write a random-weight model folder at `path` (reused if already there). vocab_size is
    the tokenizer's; model_vocab_size, when larger, the embedding's (models pad theirs)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer(vocab_size)
    cfg = make_config(arch, max(len(tokenizer), model_vocab_size or 0), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    if arch in ("qwen2",):  # random, not zero, biases so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.2)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()
