"""Engine configuration shared by the core and the workers."""

from __future__ import annotations

import msgspec

from .errors import InvalidParameter

SCHEDULER_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


class CacheConfig(msgspec.Struct, kw_only=True):
    block_size: int = 16
    num_blocks: int = 1024  # including the reserved null block 0
    num_swap_blocks: int = 0  # host swap space, in blocks
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise InvalidParameter("block_size", f"must be a power of two in 1..128, got {self.block_size}")
        if self.num_blocks < 2:
            raise InvalidParameter("num_blocks", f"must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.num_swap_blocks < 0:
            raise InvalidParameter("num_swap_blocks", f"must be >= 0, got {self.num_swap_blocks}")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    preemption_mode: str = "recompute"

    def __post_init__(self):
        for field in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, field)
            if value < 1:
                raise InvalidParameter(field, f"must be >= 1, got {value}")
        if self.policy not in SCHEDULER_POLICIES:
            raise InvalidParameter("scheduler_policy", f"must be one of {SCHEDULER_POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidParameter(
                "preemption_mode", f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )


def check_fits(cache: CacheConfig, sched: SchedulerConfig) -> None:
    """One request of max_model_len tokens must fit alone, or the scheduler could livelock."""
    usable = cache.num_blocks - 1
    needed = -(-sched.max_model_len // cache.block_size)
    if needed > usable:
        raise InvalidParameter(
            "max_model_len",
            f"{sched.max_model_len} tokens need {needed} KV blocks of {cache.block_size} but the cache "
            f"has {usable}; lower max_model_len or give the KV cache more memory",
        )
