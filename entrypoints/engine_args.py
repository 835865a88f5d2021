"""The engine's arguments as users give them (`LLM(...)`, `AsyncEngine(...)`, the CLI's engine
flags), and starting an engine from them: the engine-core process, the tokenizer, and the
input processor that checks prompts against the model."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from pagedllm.backends.registry import check_available, device_count, resolve_alias
from pagedllm.core.config import EngineConfig, parse_size
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.model_folder import ModelFolder
from pagedllm.core.quantization import resolve_quantization

from .engine_client import EngineClient
from .input_processor import InputProcessor

GiB = 1 << 30
logger = logging.getLogger("pagedllm.entrypoints")


@dataclass(kw_only=True)
class EngineArgs:
    """Named as vLLM names them. `model=None` is the demo model; `kv_cache_memory` is bytes or a
    size such as "512MiB"; `swap_space` is GiB of host swap (default 1 GiB under
    `preemption_mode="swap"`, else none); `transport` is "ipc" or "tcp" (loopback)."""

    model: str | None = None
    backend: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduler_policy: str = "fcfs"
    priority_preemption: bool = True
    block_placement: str = "lru"
    preemption_mode: str = "recompute"
    async_scheduling: bool = True
    seed: int = 0
    kv_cache_memory: int | str = "1GiB"
    swap_space: float | str | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    worker_endpoint: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_worker_restarts: int = 3
    quantization: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    transport: str = "ipc"

    def engine_config(self) -> EngineConfig:
        """The core's configuration; an unknown or unusable backend fails here, saying why."""
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
        folder = ModelFolder(model)
        folder.check_max_model_len(self.max_model_len)
        quantization = resolve_quantization(self.quantization, folder.config)
        self._check_tensor_parallel(folder, backend)
        fields = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("tokenizer", "skip_tokenizer_init", "transport", "swap_space")
        }
        return EngineConfig(
            **{
                **fields,
                "model": os.path.abspath(model),
                "backend": backend,
                "kv_cache_memory": parse_size(self.kv_cache_memory, "kv_cache_memory"),
                "swap_space": swap,
                "quantization": quantization,
            }
        )

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
        folder = ModelFolder(config.model)
        ready = engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    return engine, InputProcessor(tokenizer, folder.eos_token_ids(tokenizer), folder.vocab_size, ready.max_model_len)
