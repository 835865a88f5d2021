"""The device face of a backend: which device a rank computes on, how ranks talk, how much
memory the KV pool may take, the dtype `auto` means, pinned swap memory, graph capture,
synchronisation and seeding. The worker asks the backend for each of these and never tests a
device string itself.

`Platform`'s defaults are right for a device whose memory is the host's (the `cpu` backend):
one device, gloo between ranks, the pool sized by `--kv-cache-memory`, nothing to pin or
capture. `AttentionOps` (the kernels) derives from it, so a backend is one class: a port to an
accelerator overrides the members that differ (CUDA's are in backends/gpu/platform.py).

CONTRACT_VERSION is the version of the whole backend contract (this face and AttentionOps);
docs/porting.md says what changed between versions. A backend declares the version it was
written for in `contract_version`; SUPPORTED_CONTRACT_VERSIONS are those this pagedllm runs.
"""

from __future__ import annotations

import os

import torch

from .thread_governor import ThreadGovernor

# 1: AttentionOps alone (device, kv_in_shared_memory, device_count, prepare_process and the
#    kernels); 2: the platform face below; 3: compute_threads. An older backend runs on the
#    defaults of what it does not define. 4: sliding windows and soft-capping (supports_* and
#    the kernels' window / soft_cap keywords), which an older backend does not declare. 5: 8-bit
#    KV caches (supported_kv_cache_dtypes, kv_scales). 6: batch_invariant, the promise the
#    conformance suite's invariance rows hold. 7: add_lora, the batched multi-LoRA product.
CONTRACT_VERSION = 7
SUPPORTED_CONTRACT_VERSIONS = (1, 2, 3, 4, 5, 6, 7)


class Platform:
    """Host-memory defaults for every platform member (see the module docstring)."""

    # the contract version the backend was written for (a subclass sets its own)
    contract_version: int = CONTRACT_VERSION
    # torch device the worker loads the model onto and builds each step's inputs on
    device: str = "cpu"
    # True: the KV pool lives in the engine core's shared-memory segment (host memory), so it
    # outlives the worker; False: the backend allocates it itself, on its device
    kv_in_shared_memory: bool = True
    # torch.distributed's backend between tensor-parallel ranks
    distributed_backend: str = "gloo"

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run here (no device, no compiler), or None. Asked before
        the backend is instantiated; `--backend cuda` uses it to pick a backend."""
        return None

    @staticmethod
    def device_count() -> int | None:
        """How many devices tensor parallelism may use on one host (None: no limit, e.g. CPUs)."""
        return None

    def prepare_process(self) -> None:
        """Once, in the worker process, before the model loads (e.g. tune the allocator)."""

    def set_device(self, rank: int, ranks_per_host: int) -> None:
        """Make this rank's device current, before anything is allocated. Host default: the
        host's cores are shared by its ranks (oversubscribed threads only wait on each other)."""
        if ranks_per_host > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_host))

    def compute_threads(self, threads: int | None) -> ThreadGovernor | None:
        """The host threads steps compute with: `threads` (`--cpu-threads`) if given, else a
        ThreadGovernor that picks them per step by measurement (the host's cores are the
        device here, and other processes share them). None: the governor has no say (a device
        computes; host threads only launch its work)."""
        if threads:
            torch.set_num_threads(threads)
            return None
        return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)

    def seed(self, seed: int) -> None:
        """Seed the random generators the model and sampler may use on this device."""
        torch.manual_seed(seed)

    def default_dtype(self, model_dir: str, requested: str) -> str:
        """The model dtype for `requested` ("auto", or a dtype name). Default: "auto" stays
        "auto", which is the checkpoint's own dtype (float32 if its config names none)."""
        return requested

    def kv_cache_blocks(
        self,
        model,
        block_size: int,
        slot_bytes: int,
        max_batched_tokens: int,
        max_seq_len: int,
        memory_utilization: float,
        device,
    ) -> int | None:
        """How many KV blocks of `slot_bytes` per token slot this device has room for after the
        model and one step of `max_batched_tokens` (`--gpu-memory-utilization` of it), or None:
        the engine sizes the pool from `--kv-cache-memory`."""
        return None

    def pin_memory(self, tensor: torch.Tensor) -> None:
        """Page-lock the host swap space for faster copies to this device, where that helps."""

    def capture_graphs(self, model, kv_caches: torch.Tensor, block_size: int, max_batch: int, max_model_len: int):
        """An object that replays steps (`fits(seqs)`; `run(seqs, keep=None)` -> the final hidden
        states of the step's tokens, or of the rows `keep` indexes; see backends/gpu/graphs.py
        and backends/cpu/step_replay.py), or None: every step runs eagerly. `keep` is passed only
        where fits() takes a step of several tokens a request (a decode step's row is its
        request's). Not asked with --enforce-eager."""
        return None

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing, profiling)."""
