"""What a Hugging Face model folder says about itself: config.json and generation_config.json,
read in one place for the frontend, the workers and the benchmarks — once per process
(`model_folder`; read again only if config.json changed). Torch-free."""

from __future__ import annotations

import functools
import json
import logging
import os

from .errors import InvalidParameter

ALLOW_LONG_ENV = "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"
logger = logging.getLogger("pagedllm.model")


def rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


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

    def position_limit(self) -> tuple[int, str]:
        """The longest context the model's positions cover, and what says so. Linear rope
        scaling stretches the trained positions by its factor (as vLLM derives it); Llama 3's
        scaling is already counted in max_position_embeddings."""
        positions = self.max_position_embeddings
        rope = rope_parameters(self.config)
        if rope["rope_type"] == "linear" and rope.get("factor", 1) > 1:
            factor = rope["factor"]
            return int(positions * factor), f"max_position_embeddings {positions} x linear rope scaling {factor:g}"
        return positions, f"max_position_embeddings {positions}"

    def check_max_model_len(self, max_model_len: int | None) -> None:
        """Refuse a context longer than the model's positions (the rotary tables end there) unless
        PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 says to run past them anyway."""
        limit, source = self.position_limit()
        if max_model_len is None or max_model_len <= limit:
            return
        if os.environ.get(ALLOW_LONG_ENV) == "1":
            logger.warning(
                "max_model_len %d is past the model's %s: outputs there may be garbage", max_model_len, source
            )
            return
        raise InvalidParameter(
            "max_model_len",
            f"{max_model_len} is longer than the model allows ({source}, in {self.path}/config.json); "
            f"lower it, or set {ALLOW_LONG_ENV}=1 to run past the trained positions anyway",
        )

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


def model_folder(path: str) -> ModelFolder:
    """The folder's ModelFolder, read once per process (its config dicts are shared: read them,
    do not change them)."""
    config = os.path.join(path, "config.json")
    mtime = os.stat(config).st_mtime_ns if os.path.isfile(config) else None
    return _read_folder(os.path.abspath(path), mtime)


@functools.lru_cache(maxsize=16)
def _read_folder(path: str, mtime: int | None) -> ModelFolder:
    return ModelFolder(path)
