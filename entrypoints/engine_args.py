"""The engine's arguments as users give them (`LLM(...)`, `AsyncEngine(...)`, the CLI's engine
flags), and starting an engine from them: the engine-core process, the tokenizer, and the
input processor that checks prompts against the model."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, dataclass, field, fields

from pagedllm.backends.registry import check_available, device_count, resolve_alias
from pagedllm.core.config import (
    BLOCK_SIZES,
    KV_CACHE_DTYPES,
    PLACEMENTS,
    PREEMPTION_MODES,
    SCHEDULER_POLICIES,
    EngineConfig,
    parse_size,
    parse_speculative_config,
)
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.model_folder import ModelFolder, model_folder
from pagedllm.core.quantization import QUANTIZATIONS, resolve_quantization

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


def option(default, help: str, *, choices=None, cli_type=None):
    """One engine option: its default, its help text and allowed values. The CLI's flag and
    its help, `LLM(**kwargs)` and the servers all come from these declarations (add_cli_args);
    `cli_type` is the flag's type where the field's annotation admits several."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli_type": cli_type})


@dataclass(kw_only=True)
class EngineArgs:
    """The engine's options, named as vLLM names them: `LLM(**kwargs)`, `AsyncEngine(**kwargs)`
    and `pagedllm generate|serve --flag` (`pagedllm generate --help` lists them, with defaults)."""

    model: str | None = option(None, "Hugging Face model folder (default: the built-in demo model)")
    backend: str = option("cpu", "cpu, cuda (the best CUDA backend here), cuda-triton, cuda-native, or a plugin")
    dtype: str = option("auto", "auto (the checkpoint's; the backend may choose), float32, bfloat16 or float16")
    quantization: str | None = option(
        None,
        "weight-only quantization at load time (int8, int4, nf4); a GPTQ/AWQ checkpoint is read as saved",
        choices=QUANTIZATIONS,
    )
    block_size: int = option(16, "tokens per KV block", choices=BLOCK_SIZES)
    kv_cache_dtype: str = option(
        "auto",
        "what KV blocks hold: auto (the model's dtype), or 8-bit codes with a scale per token and KV head "
        "(fp8 = fp8_e4m3, fp8_e5m2, int8): about twice the blocks per GiB of a 16-bit cache",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = option(256, "sequences in one step at most")
    max_num_batched_tokens: int | None = option(
        None, "tokens in one step at most (default: max_model_len clamped to 2,048-8,192)"
    )
    max_model_len: int | None = option(None, "prompt + output tokens of a request (default: the model's)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of equal prompt prefixes")
    scheduler_policy: str = option("fcfs", "the order requests run in", choices=SCHEDULER_POLICIES)
    priority_preemption: bool = option(
        True, "priority policy: a waiting request preempts running ones of lower priority"
    )
    block_placement: str = option(
        "lru",
        "which free KV block a request gets: the last freed, or from the lowest / smallest run that fits",
        choices=PLACEMENTS,
    )
    preemption_mode: str = option("recompute", "how a request gives its blocks back", choices=PREEMPTION_MODES)
    async_scheduling: bool = option(True, "plan each decode step while the previous one computes")
    seed: int = option(0, "the engine's sampling seed (requests without a seed of their own)")
    kv_cache_memory: int | str = option(
        "1GiB", "KV pool size per rank, e.g. 512MiB or 4GiB (bytes as an int)", cli_type=str
    )
    swap_space: float | str | None = option(
        None, "GiB of host swap space (default: 1 under preemption_mode swap, else 0)", cli_type=float
    )
    tensor_parallel_size: int = option(1, "ranks to split the model over")
    nnodes: int = option(1, "hosts the ranks split over (the others run `pagedllm worker`)")
    worker_endpoint: str | None = option(None, "several hosts: where their ranks reach this core (tcp://)")
    master_addr: str = option("127.0.0.1", "several hosts: this host's address for torch.distributed")
    master_port: int | None = option(None, "several hosts: torch.distributed's port on this host")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (overrides kv_cache_memory)")
    gpu_memory_utilization: float = option(
        0.9, "where the backend profiles its memory (GPUs): the fraction for weights, activations and the KV pool"
    )
    cpu_threads: int | None = option(
        None,
        "threads a worker computes with on host CPUs (default: chosen per step by measurement, "
        "from 1 to the host's cores shared among its ranks)",
    )
    enforce_eager: bool = option(False, "no graph capture of decode steps (GPUs: CUDA graphs)")
    max_worker_restarts: int = option(3, "workers replaced within 10 minutes before the engine gives up")
    jump_forward: bool = option(
        True, "structured outputs: tokens the grammar forces are appended without sampling, computed in one chunk"
    )
    speculative_config: dict | str | None = option(  # noqa: RUF009 - the default is None
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 16}, or a draft model: '
        '{"model": "DRAFT_FOLDER", "num_speculative_tokens": 4} ("demo-draft": the demo model\'s)',
        cli_type=str,
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (top_logprobs) and prompt_logprobs a request may ask for; -1: no limit, and a request's -1 "
        "then asks for the whole vocabulary",
    )
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    skip_tokenizer_init: bool = option(False, "no tokenizer: prompts and outputs are token ids")
    transport: str = option(
        "ipc", "how the frontend reaches the engine core: ipc (socket files) or tcp (loopback)", choices=("ipc", "tcp")
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """A flag per option (`--block-size`), with its default, help and choices."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            kind = meta["cli_type"] or _ANNOTATION_TYPES[f.type]
            text = (
                meta["help"]
                if f.default is None or "default" in meta["help"]
                else meta["help"] + " (default: %(default)s)"
            )
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
            else:
                group.add_argument(flag, type=kind, default=f.default, choices=meta["choices"], help=text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> dict:
        """The keyword arguments the parsed flags give (for LLM, AsyncEngine, EngineArgs)."""
        return {f.name: getattr(args, f.name) for f in fields(cls)}

    def engine_config(self) -> EngineConfig:
        """The core's configuration; an unknown or unusable backend fails here, saying why."""
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
        fields = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("tokenizer", "skip_tokenizer_init", "transport", "swap_space", "max_logprobs")
        }
        return EngineConfig(
            **{
                **fields,
                "model": os.path.abspath(model),
                "backend": backend,
                "kv_cache_memory": parse_size(self.kv_cache_memory, "kv_cache_memory"),
                "swap_space": swap,
                "quantization": quantization,
                "speculative_config": self._speculative_config(),
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
        tokenizer, folder.eos_token_ids(tokenizer), folder.vocab_size, ready.max_model_len, args.max_logprobs
    )
    return engine, inputs
