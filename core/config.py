"""Engine configuration shared by the core and the workers."""

from __future__ import annotations

import msgspec

from .errors import InvalidParameter
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


class CacheConfig(msgspec.Struct, kw_only=True):
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


class SchedulerConfig(msgspec.Struct, kw_only=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    priority_preemption: bool = True  # priority policy: a waiting request preempts lower-priority work
    preemption_mode: str = "recompute"
    # structured outputs: tokens the grammar forces are appended at once, computed in one chunk
    jump_forward: bool = True
    speculative: SpeculativeConfig | None = None

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


class EngineConfig(msgspec.Struct, kw_only=True):
    """Everything the engine core needs to start. Field names follow vLLM's engine flags."""

    model: str
    backend: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: default_batched_tokens(max_model_len)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    scheduler_policy: str = "fcfs"
    priority_preemption: bool = True
    block_placement: str = "lru"
    preemption_mode: str = "recompute"
    # plan step k+1 while step k computes, whenever it needs none of step k's tokens
    async_scheduling: bool = True
    seed: int = 0
    kv_cache_memory: int = 1 << 30  # bytes of KV pool (cpu backend)
    num_kv_blocks: int | None = None  # exact pool size, overriding kv_cache_memory
    swap_space: int = 0  # bytes of host swap space
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # several hosts: the ranks split evenly over `nnodes`, the head node (this one) has the first;
    # the others start theirs with `pagedllm worker`, reaching the core at `worker_endpoint`
    nnodes: int = 1
    worker_endpoint: str | None = None  # where workers reach the core (default: private to this host)
    master_addr: str = "127.0.0.1"  # torch.distributed's rendezvous, on the head node
    master_port: int | None = None  # default: a free port (one host only)
    enforce_eager: bool = False
    cpu_threads: int | None = None  # host threads a worker computes with (None: its governor picks)
    max_worker_restarts: int = 3  # within 10 minutes; past it the engine is dead
    jump_forward: bool = True  # structured outputs: append the tokens a grammar forces, unsampled
    quantization: str | None = None  # core/quantization.py: a load-time mode, or the checkpoint's method
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    speculative_config: SpeculativeConfig | None = None  # core/scheduling/speculation.py

    def __post_init__(self):
        _check_block_size(self.block_size)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _check_positive(
            self, ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "cpu_threads")
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
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as e:
            raise InvalidParameter("speculative_config", f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameter("speculative_config", f"must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(SpeculativeConfig.__struct_fields__))
    if unknown:
        raise InvalidParameter("speculative_config", f"unknown fields {unknown}")
    try:
        return SpeculativeConfig(**value)
    except TypeError as e:  # a value of the wrong type
        raise InvalidParameter("speculative_config", str(e)) from None
