"""The hardware-agnostic core: block pool, KV cache manager, scheduler. Never imports torch."""

from .config import CacheConfig, SchedulerConfig
from .errors import InvalidParameter
from .request import EngineRequest, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler

__all__ = [
    "CacheConfig",
    "SchedulerConfig",
    "InvalidParameter",
    "EngineRequest",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
]
