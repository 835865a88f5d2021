"""Every message on pagedllm's internal sockets, and how they are encoded.

All messages are msgspec Structs encoded as msgpack; nothing is pickled. A message is sent as
one or more ZeroMQ frames: frame 0 is the msgpack body; numpy arrays inside it travel as
further frames, referenced from the body by an extension type, so large integer arrays are
neither copied into the body on send nor out of the frame on receive.

Frontend -> core:  AddRequests, AbortRequests, Shutdown        (PUSH -> PULL)
Core -> frontend:  EngineReady, EngineOutputs, RequestRejected, EngineDead, EngineRecovering, EngineRecovered
Core -> workers:   Configure, InitCache, Step, StepMasks, Heartbeat, Shutdown   (ROUTER -> DEALER per rank)
Workers -> core:   WorkerJoin, WorkerHello, WorkerReady, StepResult, WorkerFailed
"""

from __future__ import annotations

import msgspec
import numpy as np

from .config import EngineConfig
from .outputs import PromptLogprobs, RequestOutputDelta, SchedulerOutput, SchedulerStats, TokenLogprobs
from .request import EngineRequest

_NDARRAY_EXT = 1


# --- frontend <-> core ---------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag="add"):
    """One or more requests; a batch arrives whole, so the core schedules it as one (an offline
    `generate` call is then independent of how fast the frontend sends)."""

    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Forget the prefix cache, where no request holds a block (vLLM's reset_prefix_cache)."""


class EngineStats(msgspec.Struct):
    scheduler: SchedulerStats
    steps: int
    step_seconds: float  # core wall time over all steps: schedule to update
    forward_seconds: float  # of which the worker's model forward and sampling
    # the steps since the previous stats: requests in each step's batch, and tokens computed
    batch_sizes: list[int] = []
    batch_tokens: list[int] = []
    planned_ahead: int = 0  # steps planned before the previous step's tokens came (async scheduling)
    steps_in_runs: int = 0  # of those, steps of decode runs past their first: no plan of their own
    worker_restarts: int = 0  # since start
    recovered_tokens: int = 0  # computed tokens restarts kept instead of recomputing


class EngineReady(msgspec.Struct, tag="ready"):
    num_blocks: int
    num_swap_blocks: int
    block_size: int
    max_model_len: int
    backend: str
    # per rank: the shared-memory segment of its KV pool, or None (device memory, another host)
    kv_segments: list[str | None]
    # this host's worker launcher, whose children the local workers are: the core's own child, or
    # a launcher server's (core/process/local_workers.py)
    launcher_pid: int | None = None
    # every rank's backend promises a request the same bits whatever runs beside it
    batch_invariant: bool = False


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutputDelta]
    stats: EngineStats | None = None


class RequestRejected(msgspec.Struct, tag="rejected"):
    """A request refused (a parameter the core checks) or ended by an error in the engine
    (`internal`: the client is not at fault; the core logged why)."""

    request_id: str
    field: str | None
    message: str
    internal: bool = False


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


class EngineRecovering(msgspec.Struct, tag="recovering"):
    """A worker failed and is being replaced; requests pause, none fails."""

    reason: str


class EngineRecovered(msgspec.Struct, tag="recovered"):
    num_workers: int


FrontendMessage = AddRequests | AbortRequests | Shutdown | ResetPrefixCache
CoreMessage = EngineReady | EngineOutputs | RequestRejected | EngineDead | EngineRecovering | EngineRecovered


# --- core <-> worker -----------------------------------------------------------------------
class KVSpec(msgspec.Struct):
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # float32, bfloat16, float16
    kv_cache_dtype: str = "auto"  # or an 8-bit format: a code byte per element, a float32 scale per row
    # a draft model's KV, in the same pool after the target's (speculative decoding); not swapped
    draft_bytes_per_slot: int = 0

    @property
    def bytes_per_block_slot(self) -> int:
        """The target model's KV of one token slot (what swap space holds)."""
        if self.kv_cache_dtype != "auto":
            return 2 * self.num_layers * self.num_kv_heads * (self.head_size + 4)
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    @property
    def pool_bytes_per_slot(self) -> int:
        """One token slot of the pool: the target's KV and a draft model's."""
        return self.bytes_per_block_slot + self.draft_bytes_per_slot


DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class WorkerJoin(msgspec.Struct, tag="join"):
    """A worker process has connected; it waits for its Configure."""

    rank: int
    host: str
    pid: int


class Configure(msgspec.Struct, tag="configure"):
    config: EngineConfig
    # the torch.distributed rendezvous of the tensor-parallel ranks (unused when there is one)
    master_addr: str
    master_port: int
    # which start of the workers this is (the core counts restarts): the worker stamps it on
    # every message after this one, so that a late message of a replaced group is known as such
    generation: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The core is alive (sent while it has nothing else to say, for workers on other hosts)."""


class FromWorkerMessage(msgspec.Struct):
    """A message a configured worker sends: `generation` is its Configure's (-1: not yet
    configured)."""

    generation: int = -1


class WorkerHello(FromWorkerMessage, tag="hello", kw_only=True):
    rank: int
    kv_spec: KVSpec
    max_position_embeddings: int
    sliding_window: int | None  # every layer's window, where all have one: blocks out of it are freed
    kv_in_shared_memory: bool  # the backend keeps its KV pool in host shared memory
    num_device_blocks: int | None  # GPU backends: blocks that fit after profiling
    batch_invariant: bool = False  # the backend promises the same bits whatever the batch


class InitCache(msgspec.Struct, tag="init_cache"):
    num_blocks: int
    num_swap_blocks: int
    block_size: int
    kv_segment: str | None
    swap_segment: str | None
    max_model_len: int


class WorkerReady(FromWorkerMessage, tag="worker_ready", kw_only=True):
    rank: int


class Step(msgspec.Struct, tag="step"):
    plan: SchedulerOutput


class StepMasks(msgspec.Struct, tag="masks"):
    """Structured outputs: the token bitmasks of a step's constrained rows (plan.
    structured_request_ids, in that order), sent to rank 0 right after the step itself, so that
    the core computes them while the workers run the forward pass; rank 0 waits for them only
    when it samples."""

    step_id: int
    bitmask: np.ndarray  # int32 [rows, ceil(vocab / 32)]


class StepResult(FromWorkerMessage, tag="result", kw_only=True):
    step_id: int
    # one per scheduled request, in the plan's order; -1 where a prefill chunk sampled nothing
    sampled_token_ids: np.ndarray
    logprobs: dict[str, TokenLogprobs] | None = None
    forward_seconds: float = 0.0
    prompt_logprobs: dict[str, PromptLogprobs] | None = None  # of requests that asked, by request id
    # speculative decoding: each speculating request's tokens of this step (the proposed ones the
    # model confirmed, then its own next one), by request id
    spec_token_ids: dict[str, list[int]] | None = None
    spec_logprobs: dict[str, list[TokenLogprobs]] | None = None  # of those tokens, where asked
    pooled: dict[str, list[float]] | None = None  # embeddings whose prompt this step completed, by request id


class WorkerFailed(FromWorkerMessage, tag="failed", kw_only=True):
    rank: int
    reason: str


ToWorker = Configure | InitCache | Step | StepMasks | Heartbeat | Shutdown
FromWorker = WorkerJoin | WorkerHello | WorkerReady | StepResult | WorkerFailed


# --- encoding ------------------------------------------------------------------------------
class Encoder:
    """msgpack with numpy arrays out of band: encode() returns the frames to send."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffers: list = []

    def encode(self, message) -> list:
        self._buffers = [None]
        body = self._encoder.encode(message)
        frames, self._buffers = self._buffers, []
        frames[0] = body
        return frames

    def _enc_hook(self, obj):
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            self._buffers.append(arr.data)
            header = msgspec.msgpack.encode((arr.dtype.str, arr.shape, len(self._buffers) - 1))
            return msgspec.msgpack.Ext(_NDARRAY_EXT, header)
        raise TypeError(f"cannot encode {type(obj).__name__} on a pagedllm socket")


class Decoder:
    def __init__(self, message_type):
        self._decoder = msgspec.msgpack.Decoder(message_type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._frames: list = []

    def decode(self, frames: list):
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview):
        if code != _NDARRAY_EXT:
            raise msgspec.ValidationError(f"unknown extension type {code}")
        dtype, shape, index = msgspec.msgpack.decode(data)
        return np.frombuffer(self._frames[index], dtype=np.dtype(dtype)).reshape(shape)

    @staticmethod
    def _dec_hook(type_, obj):
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise msgspec.ValidationError(f"expected {type_}, got {type(obj).__name__}")
