"""Engine configuration shared by the core and the workers."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import msgspec

from .errors import InvalidParameter
from .kv_events import KVEventsConfig
from .quantization import QUANTIZATIONS
from .sampling_params import PoolingParams
from .utils import cdiv

SCHEDULER_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# what KV blocks hold: the model's dtype, or 8-bit codes with a float32 scale per (token, KV head)
# row (backends/kv_cache.py); "fp8" is vLLM's name for fp8_e4m3
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
PLACEMENTS = ("lru", "first-fit", "best-fit")  # which free block a request gets (core/scheduling/free_blocks.py)


def default_batched_tokens(max_model_len: int) -> int:
    """The step budget when none is set: a whole prompt of up to 8,192 tokens in one step (at
    least 2,048); longer prompts are prefilled in chunks, as vLLM's default budget does. It also
    bounds the start-up profiling step on a GPU (one 131k-token prefill would not finish)."""
    return max(2048, min(max_model_len, 8192))


def _check_choice(field: str, value, choices: tuple) -> None:
    if value not in choices:
        raise InvalidParameter(field, f"must be one of {choices}, got {value!r}")


def _check_block_size(value: int) -> None:
    if value not in BLOCK_SIZES:
        raise InvalidParameter("block_size", f"must be a power of two in 1..128, got {value}")


def _check_positive(owner, fields) -> None:
    for field in fields:
        value = getattr(owner, field)
        if value is not None and value < 1:
            raise InvalidParameter(field, f"must be >= 1, got {value}")


# the scheduler's names of the engine options it takes under other names
_SCHEDULER_NAMES = {"policy": "scheduler_policy", "speculative": "speculative_config"}


class _FromEngine:
    @classmethod
    def of(cls, engine: EngineConfig, **resolved):
        """From the engine's options (same names, or those _SCHEDULER_NAMES gives), with the
        values sized at start-up (`resolved`)."""
        values = {}
        for name in cls.__struct_fields__:
            source = _SCHEDULER_NAMES.get(name, name)
            if name in resolved:
                values[name] = resolved[name]
            elif hasattr(engine, source):
                values[name] = getattr(engine, source)
        return cls(**values)


class CacheConfig(_FromEngine, msgspec.Struct, kw_only=True):
    block_size: int = 16
    num_blocks: int = 1024  # including the reserved null block 0
    num_swap_blocks: int = 0  # host swap space, in blocks
    enable_prefix_caching: bool = True
    block_placement: str = "lru"  # which free block a request gets (core/scheduling/free_blocks.py)
    sliding_window: int | None = None  # every layer's window: blocks behind it are released

    def __post_init__(self):
        _check_block_size(self.block_size)
        _check_choice("block_placement", self.block_placement, PLACEMENTS)
        if self.num_blocks < 2:
            raise InvalidParameter("num_blocks", f"must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.num_swap_blocks < 0:
            raise InvalidParameter("num_swap_blocks", f"must be >= 0, got {self.num_swap_blocks}")


class SchedulerConfig(_FromEngine, msgspec.Struct, kw_only=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    priority_preemption: bool = True  # priority policy: a waiting request preempts lower-priority work
    preemption_mode: str = "recompute"
    # structured outputs: tokens the grammar forces are appended at once, computed in one chunk
    jump_forward: bool = True
    speculative: SpeculativeConfig | None = None
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step

    def __post_init__(self):
        _check_positive(self, ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
        _check_choice("scheduler_policy", self.policy, SCHEDULER_POLICIES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)


def check_fits(cache: CacheConfig, sched: SchedulerConfig) -> None:
    """One request of max_model_len tokens must fit alone, or the scheduler could livelock.
    With a sliding window on every layer it holds at most the window and one step's tokens."""
    usable = cache.num_blocks - 1
    needed = cdiv(sched.max_model_len, cache.block_size)
    if cache.sliding_window:
        held = cache.sliding_window + sched.max_num_batched_tokens
        needed = min(needed, cdiv(held, cache.block_size) + 1)
    if needed > usable and cache.sliding_window and needed < cdiv(sched.max_model_len, cache.block_size):
        raise InvalidParameter(
            "max_num_batched_tokens",
            f"a request holds its {cache.sliding_window}-token window and a step of up to "
            f"{sched.max_num_batched_tokens} tokens: {needed} KV blocks of {cache.block_size}, but the cache has "
            f"{usable}; lower max_num_batched_tokens or give the KV cache more memory",
        )
    if needed > usable:
        raise InvalidParameter(
            "max_model_len",
            f"{sched.max_model_len} tokens need {needed} KV blocks of {cache.block_size} but the cache "
            f"has {usable}; lower max_model_len or give the KV cache more memory",
        )


def parse_size(value, field: str) -> int:
    """Bytes from an int or a string such as '512MiB', '4GiB', '1.5GB' (GB = GiB here)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        for suffix, scale in (
            ("gib", 1 << 30),
            ("gb", 1 << 30),
            ("g", 1 << 30),
            ("mib", 1 << 20),
            ("mb", 1 << 20),
            ("m", 1 << 20),
            ("kib", 1 << 10),
            ("kb", 1 << 10),
            ("k", 1 << 10),
            ("b", 1),
            ("", 1),
        ):
            if text.endswith(suffix):
                try:
                    return int(float(text[: len(text) - len(suffix)] or "x") * scale)
                except ValueError:
                    break
    raise InvalidParameter(field, f"must be a size such as 4GiB or 512MiB, got {value!r}")


# --- speculative decoding (core/scheduling/speculation.py) -----------------------------------
METHODS = {"ngram": False, "draft_model": True}  # method: whether it takes a draft model
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `speculative_config` fields for the n-gram and draft-model methods."""

    method: str | None = None  # "draft_model" where a model is given, else "ngram"
    model: str | None = None  # the draft model's folder (draft_model)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # the longest suffix matched against earlier tokens
    prompt_lookup_min: int = 1  # the shortest
    # no speculation in a step with more running requests than this (vLLM's name): a full batch
    # is bound by arithmetic, and verifying rejected tokens costs more than it saves
    disable_by_batch_size: int | None = 16

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        takes_model = METHODS.get(self.method)
        if takes_model is None:
            raise InvalidParameter("speculative_config.method", f"must be one of {tuple(METHODS)}, got {self.method!r}")
        if takes_model and not self.model:
            raise InvalidParameter("speculative_config.model", f"the draft model's folder is required by {self.method}")
        if not takes_model and self.model:
            message = f"is a draft model's: the {self.method} method takes none"
            raise InvalidParameter("speculative_config.model", message)
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameter(
                "speculative_config.num_speculative_tokens",
                f"must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameter(
                "speculative_config.prompt_lookup_min",
                f"must be >= 1 and <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}",
            )


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """From a dict, a JSON string (the CLI's --speculative-config) or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return _json_config(value, SpeculativeConfig, "speculative_config")


def parse_pooler_config(value) -> PoolingParams:
    """From a dict, a JSON string (the CLI's --pooler-config) or None (LAST, normalized)."""
    if value is None or isinstance(value, PoolingParams):
        return value or PoolingParams()
    return _json_config(value, PoolingParams, "pooler_config")


def parse_kv_events_config(value) -> KVEventsConfig | None:
    """From a dict, a JSON string (the CLI's --kv-events-config) or None."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return _json_config(value, KVEventsConfig, "kv_events_config")


def _json_config(value, cls, field: str):
    """A config struct from a dict or its JSON text; InvalidParameter naming the field (and
    the struct's own field, where it refuses one)."""
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as e:
            raise InvalidParameter(field, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameter(field, f"must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(cls.__struct_fields__))
    if unknown:
        raise InvalidParameter(field, f"unknown fields {unknown}")
    try:
        return cls(**value)
    except TypeError as e:  # a value of the wrong type
        raise InvalidParameter(field, str(e)) from None
    except InvalidParameter as e:
        if e.field.startswith(field):
            raise
        raise e.renamed(f"{field}.{e.field}") from None


# --- the engine's options ----------------------------------------------------------------
DEFAULT_KV_CACHE_MEMORY = "1GiB"
REQUIRED = object()  # a resolved field with no default


def option(default, help: str, *, choices=None, cli_type=None, resolved=None, frontend: bool = False):
    """One engine option: its default, its help text and allowed values. The CLI's flag and
    its help (entrypoints/engine_args.py), `LLM(**kwargs)`, the servers, the benchmarks' flags
    and the core's EngineConfig all come from these declarations. `cli_type`: the flag's type
    where the annotation admits several; `resolved`: (type, default) of the field in
    EngineConfig where the frontend resolves what a user gives (a size as text, a path);
    `frontend`: the frontend's alone, not in EngineConfig."""
    meta = {"help": help, "choices": choices, "cli_type": cli_type, "resolved": resolved, "frontend": frontend}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(kw_only=True)
class EngineOptions:
    """The engine's options, named as vLLM names them, declared once: `LLM(**kwargs)`,
    `AsyncEngine(**kwargs)` and `pagedllm generate|serve --flag` take them (entrypoints'
    EngineArgs), and EngineConfig, what the core is sent, is made from them."""

    model: str | None = option(
        None, "Hugging Face model folder (default: the built-in demo model)", resolved=(str, REQUIRED)
    )
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
    num_scheduler_steps: int | None = option(
        None,
        "async scheduling: decode steps a worker runs on its own while the batch is steady (vLLM's multi-step "
        "scheduling); default: up to 8, as many as take about 4 ms; 1: the core plans every step",
    )
    seed: int = option(0, "the engine's sampling seed (requests without a seed of their own)")
    kv_cache_memory: int | str = option(
        DEFAULT_KV_CACHE_MEMORY,
        "KV pool size per rank, e.g. 512MiB or 4GiB (bytes as an int)",
        cli_type=str,
        resolved=(int, parse_size(DEFAULT_KV_CACHE_MEMORY, "kv_cache_memory")),
    )
    swap_space: float | str | None = option(
        None,
        "GiB of host swap space (default: 1 under preemption_mode swap, else 0)",
        cli_type=float,
        resolved=(int, 0),  # bytes
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
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT folders) beside the base model, per request")
    max_loras: int = option(1, "LoRA adapters one step may mix (their weights resident at once)")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory (default: max_loras)")
    max_worker_restarts: int = option(3, "workers replaced within 10 minutes before the engine gives up")
    jump_forward: bool = option(
        True, "structured outputs: tokens the grammar forces are appended without sampling, computed in one chunk"
    )
    batch_invariant: bool = option(
        False,
        "a request's tokens and logprobs the same bits whatever runs beside it where that costs speed: on the "
        "cpu backend, quantized layers then take one kernel at every batch size (dense models are invariant "
        "without it)",
    )
    speculative_config: dict | str | None = option(  # noqa: RUF009 - the default is None
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 16}, or a draft model: '
        '{"model": "DRAFT_FOLDER", "num_speculative_tokens": 4} ("demo-draft": the demo model\'s)',
        cli_type=str,
        resolved=(SpeculativeConfig | None, None),
    )
    kv_events_config: dict | str | None = option(  # noqa: RUF009 - the default is None
        None,
        "publish the prefix cache's changes as vLLM's KV events: {\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}',
        cli_type=str,
        resolved=(KVEventsConfig | None, None),
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (top_logprobs) and prompt_logprobs a request may ask for; -1: no limit, and a request's -1 "
        "then asks for the whole vocabulary",
        frontend=True,
    )
    runner: str = option(
        "generate",
        "generate: text (completions, chat); pooling: embeddings of the prompts (/v1/embeddings, LLM.embed), "
        "as vLLM's --runner",
        choices=("generate", "pooling"),
        frontend=True,
    )
    pooler_config: dict | str | None = option(  # noqa: RUF009 - the default is None
        None,
        'with --runner pooling, as vLLM\'s JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true} '
        "(default: LAST, normalized)",
        cli_type=str,
        frontend=True,
    )
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)", frontend=True)
    skip_tokenizer_init: bool = option(False, "no tokenizer: prompts and outputs are token ids", frontend=True)
    transport: str = option(
        "ipc",
        "how the frontend reaches the engine core: ipc (socket files) or tcp (loopback)",
        choices=("ipc", "tcp"),
        frontend=True,
    )


def _check_lora(cfg) -> None:
    """What LoRA serving composes with so far: everything but speculative decoding."""
    _check_positive(cfg, ("max_loras", "max_lora_rank", "max_cpu_loras"))
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise InvalidParameter("max_cpu_loras", f"must be >= max_loras ({cfg.max_loras}), got {cfg.max_cpu_loras}")
    if cfg.speculative_config is not None:
        raise InvalidParameter("enable_lora", "LoRA adapters do not run with speculative decoding yet")


class _EngineConfigChecks(msgspec.Struct, kw_only=True):
    """EngineConfig's checks; its fields are EngineOptions' (make_engine_config)."""

    def __post_init__(self):
        _check_block_size(self.block_size)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _check_positive(
            self,
            (
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "num_kv_blocks",
                "cpu_threads",
                "num_scheduler_steps",
            ),
        )
        _check_choice("scheduler_policy", self.scheduler_policy, SCHEDULER_POLICIES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("block_placement", self.block_placement, PLACEMENTS)
        if self.kv_cache_memory < 1:
            raise InvalidParameter("kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise InvalidParameter("swap_space", f"must be >= 0, got {self.swap_space}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameter("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check_positive(self, ("tensor_parallel_size", "nnodes"))
        if self.enable_lora:
            _check_lora(self)
        if self.max_worker_restarts < 0:
            raise InvalidParameter("max_worker_restarts", f"must be >= 0, got {self.max_worker_restarts}")
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidParameter(
                "nnodes", f"{self.nnodes} nodes cannot share {self.tensor_parallel_size} ranks evenly"
            )
        if self.nnodes > 1 and (self.worker_endpoint is None or self.master_port is None):
            raise InvalidParameter(
                "worker_endpoint", "several nodes need a tcp:// worker_endpoint and a master_port the others can reach"
            )

    def ranks_of_node(self, node_rank: int) -> range:
        per_node = self.tensor_parallel_size // self.nnodes
        return range(node_rank * per_node, (node_rank + 1) * per_node)


def make_engine_config() -> type:
    """EngineConfig: everything the engine core needs to start, sent to it and to each worker.
    Its fields are EngineOptions' (their names, defaults and types; the resolved type and
    default where the frontend resolves what a user gives), but the frontend's own."""
    hints = typing.get_type_hints(EngineOptions)
    fields = []
    for f in dataclasses.fields(EngineOptions):
        if f.metadata["frontend"]:
            continue
        kind, default = f.metadata["resolved"] or (hints[f.name], f.default)
        fields.append((f.name, kind) if default is REQUIRED else (f.name, kind, default))
    return msgspec.defstruct("EngineConfig", fields, bases=(_EngineConfigChecks,), kw_only=True, module=__name__)


EngineConfig = make_engine_config()
