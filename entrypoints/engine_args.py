"""The engine's arguments as users give them (`LLM(...)`, `AsyncEngine(...)`, the CLI's engine
flags), and starting an engine from them: the engine-core process, the tokenizer, and the
input processor that checks prompts against the model."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields

from pagedllm.backends.registry import check_available, device_count, resolve_alias
from pagedllm.core.config import (
    EngineConfig,
    EngineOptions,
    parse_kv_events_config,
    parse_pooler_config,
    parse_size,
    parse_speculative_config,
)
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.model_folder import ModelFolder, model_folder
from pagedllm.core.quantization import resolve_quantization

from .engine_client import EngineClient
from .input_processor import InputProcessor

GiB = 1 << 30
DEMO_DRAFT = "demo-draft"
logger = logging.getLogger("pagedllm.entrypoints")
# a field's annotation (a string: postponed annotations) -> the type of its CLI flag
_ANNOTATION_TYPES = {
    "str": str,
    "str | None": str,
    "int": int,
    "int | None": int,
    "float": float,
    "bool": bool,
}


@dataclass(kw_only=True)
class EngineArgs(EngineOptions):
    """The engine's options (declared in core/config.py: EngineOptions) as users give them,
    turned into the core's EngineConfig and CLI flags."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only=None, defaults: dict | None = None) -> None:
        """A flag per option (`--block-size`), with its default, help and choices; `only`: these
        options' alone; `defaults`: defaults of the caller's own (the benchmarks')."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            kind = meta["cli_type"] or _ANNOTATION_TYPES[f.type]
            default = (defaults or {}).get(f.name, f.default)
            text = (
                meta["help"]
                if default is None or "default" in meta["help"]
                else meta["help"] + " (default: %(default)s)"
            )
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
            else:
                group.add_argument(flag, type=kind, default=default, choices=meta["choices"], help=text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> dict:
        """The keyword arguments the parsed flags give (for LLM, AsyncEngine, EngineArgs)."""
        return {f.name: getattr(args, f.name) for f in fields(cls)}

    def engine_config(self) -> EngineConfig:
        """The core's configuration; an unknown or unusable backend fails here, saying why."""
        if self.runner not in ("generate", "pooling"):
            raise InvalidParameter("runner", f"must be generate or pooling, got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise InvalidParameter("pooler_config", "needs --runner pooling")
        parse_pooler_config(self.pooler_config)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InvalidParameter(
                "max_logprobs", f"must be an integer >= -1 (-1: no limit), got {self.max_logprobs!r}"
            )
        backend, picked = resolve_alias(self.backend)  # "cuda" -> the best CUDA backend here
        if picked:
            logger.warning(picked)
        check_available(backend)
        model = self.model
        if model is None:
            from .default_model import default_model_dir

            model = default_model_dir()
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise InvalidParameter("model", f"{model!r} is not a folder with a config.json")
        if self.swap_space is None:
            swap = GiB if self.preemption_mode == "swap" else 0
        elif isinstance(self.swap_space, str):
            swap = parse_size(self.swap_space, "swap_space")
        else:
            swap = int(self.swap_space * GiB)  # vLLM's unit: GiB
        folder = model_folder(model)
        folder.check_max_model_len(self.max_model_len)
        quantization = resolve_quantization(self.quantization, folder.config)
        self._check_tensor_parallel(folder, backend)
        return EngineConfig(
            **{
                **{f.name: getattr(self, f.name) for f in fields(self) if not f.metadata["frontend"]},
                "model": os.path.abspath(model),
                "backend": backend,
                "kv_cache_memory": parse_size(self.kv_cache_memory, "kv_cache_memory"),
                "swap_space": swap,
                "quantization": quantization,
                "speculative_config": self._speculative_config(),
                "kv_events_config": parse_kv_events_config(self.kv_events_config),
            }
        )

    def _speculative_config(self):
        """The parsed config, its draft model's folder checked and made absolute ("demo-draft":
        the draft of the demo model that ships with the package)."""
        spec = parse_speculative_config(self.speculative_config)
        if spec is None or spec.model is None:
            return spec
        path = spec.model
        if path == DEMO_DRAFT:
            from .default_model import shipped_draft_dir

            path = shipped_draft_dir()
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InvalidParameter("speculative_config.model", f"{spec.model!r} is not a folder with a config.json")
        spec.model = os.path.abspath(path)
        return spec

    def _check_tensor_parallel(self, folder: ModelFolder, backend: str) -> None:
        """Refused before anything starts: a split the model does not allow, or more ranks on
        this host than it has devices."""
        size = self.tensor_parallel_size
        if size == 1:
            return
        folder.check_tensor_parallel(size)
        devices = device_count(backend)
        per_node = size // max(self.nnodes, 1)
        if devices is not None and per_node > devices:
            raise InvalidParameter(
                "tensor_parallel_size", f"{per_node} ranks on this host, but {backend} sees {devices} devices here"
            )


def start_engine(args: EngineArgs) -> tuple[EngineClient, InputProcessor]:
    """Start the engine processes and, while they start, load the tokenizer; return once the
    engine is ready."""
    config = args.engine_config()
    engine = EngineClient(config, args.transport)
    try:
        tokenizer = None
        if not args.skip_tokenizer_init:
            from .tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer or config.model)
        folder = model_folder(config.model)
        ready = engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    inputs = InputProcessor(
        tokenizer,
        folder.eos_token_ids(tokenizer),
        folder.vocab_size,
        ready.max_model_len,
        args.max_logprobs,
        parse_pooler_config(args.pooler_config) if args.runner == "pooling" else None,
        (folder.config, config.max_lora_rank) if config.enable_lora else None,
    )
    return engine, inputs
