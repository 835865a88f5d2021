"""What a Hugging Face model folder says about itself: config.json and generation_config.json,
read in one place for the frontend, the workers and the benchmarks. Torch-free."""

from __future__ import annotations

import json
import os

from .errors import InvalidParameter


class ModelFolder:
    def __init__(self, path: str):
        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"model: no config.json in {path!r}")
        with open(config_path) as f:
            self.config: dict = json.load(f)
        generation_path = os.path.join(path, "generation_config.json")
        self.generation_config: dict | None = None
        if os.path.isfile(generation_path):
            with open(generation_path) as f:
                self.generation_config = json.load(f)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def max_position_embeddings(self) -> int:
        return self.config.get("max_position_embeddings", 2048)

    @property
    def dtype(self) -> str | None:
        """The dtype the checkpoint was saved in, if config.json names one."""
        return self.config.get("dtype") or self.config.get("torch_dtype")

    def eos_token_ids(self, tokenizer=None) -> list[int]:
        """The ids that end generation, as transformers' `generate` reads them: from
        generation_config.json when the folder has one, else from config.json; an int or a list
        (Llama 3 lists several). Where neither names any, the tokenizer's EOS, as vLLM does."""
        source = self.generation_config if self.generation_config is not None else self.config
        eos = source.get("eos_token_id")
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            return []
        return [int(t) for t in eos] if isinstance(eos, list) else [int(eos)]

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse a split the model's shape does not allow, naming the numbers."""
        cfg = self.config
        heads = cfg["num_attention_heads"]
        check_tensor_parallel(heads, cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"], size)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    field = "tensor_parallel_size"
    if num_heads % size:
        raise InvalidParameter(field, f"{size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise InvalidParameter(field, f"{size} and the model's {num_kv_heads} KV heads: one must divide the other")
    if intermediate_size % size:
        raise InvalidParameter(field, f"{size} does not divide the model's intermediate size {intermediate_size}")
