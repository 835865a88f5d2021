"""The hardware-agnostic core. Never imports torch. Three parts (docs/architecture.md):
the vocabulary every process shares (the modules here), the scheduling brain (scheduling/)
and the engine core's process plumbing (process/).

The names below load on first use: a process that needs one module of the core (the engine
core's entry point starting the worker launcher first thing) does not wait for the rest."""

import importlib

_EXPORTS = {
    "CacheConfig": "config",
    "SchedulerConfig": "config",
    "InvalidParameter": "errors",
    "EngineRequest": "request",
    "Request": "request",
    "RequestStatus": "request",
    "SamplingParams": "sampling_params",
    "Scheduler": "scheduling.scheduler",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
