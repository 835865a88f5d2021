"""Backend registry: built-in backends and out-of-tree ones from the entry-point group
`pagedllm.backends`. Importing this module imports no torch: a backend's module is imported
only when it is loaded. A backend is refused, naming the versions, when the contract version
it declares is not one this pagedllm runs (backends/platform.py)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "pagedllm.backends"

# name -> "module:attribute" of a callable returning an AttentionOps
BUILTIN_BACKENDS = {
    "cpu": "pagedllm.backends.cpu:CpuAttentionOps",
    "cuda-triton": "pagedllm.backends.triton:TritonAttentionOps",
    "cuda-native": "pagedllm.backends.cuda_native:NativeCudaAttentionOps",
}


# aliases: the first of these that can run here is used
ALIASES = {
    # Triton's prefill uses tensor cores (flash-attention tiles); cuda-native's kernels do not,
    # and need a compiler. Either passes the same conformance suite.
    "cuda": ("cuda-triton", "cuda-native")
}


@dataclass
class BackendSpec:
    name: str
    target: str  # module:attribute
    builtin: bool


class UnknownBackend(ValueError):
    pass


def available_backends() -> dict[str, BackendSpec]:
    specs = {name: BackendSpec(name, target, True) for name, target in BUILTIN_BACKENDS.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in specs:
            specs[ep.name] = BackendSpec(ep.name, ep.value, False)
    return specs


def resolve(name: str) -> BackendSpec:
    if name in BUILTIN_BACKENDS:  # no plugin takes a built-in's name: every package's entry points unread
        return BackendSpec(name, BUILTIN_BACKENDS[name], True)
    specs = available_backends()
    if name not in specs:
        known = sorted(specs) + sorted(ALIASES)
        raise UnknownBackend(f"backend: unknown backend {name!r}; known backends: {', '.join(known)}")
    return specs[name]


def resolve_alias(name: str) -> tuple[str, str | None]:
    """(concrete backend name, a line saying what an alias picked, or None)."""
    if name not in ALIASES:
        return name, None
    reasons = []
    for candidate in ALIASES[name]:
        try:
            check_available(candidate)
        except (BackendUnavailable, UnknownBackend) as e:
            reasons.append(str(e))
            continue
        return candidate, f"backend {name}: using {candidate}"
    raise BackendUnavailable(f"{name}: no backend for it can run here: {'; '.join(reasons)}")


class BackendUnavailable(RuntimeError):
    pass


# built-in backends that run wherever torch runs: nothing to ask them, so the frontend need not
# import them (and torch, 1.5 s) before it starts an engine
RUN_EVERYWHERE = {"cpu"}


def check_available(name: str) -> BackendSpec:
    """Resolve the name and ask the backend whether it can run here (e.g. 'no CUDA device')."""
    spec = resolve(name)
    if spec.builtin and name in RUN_EVERYWHERE:
        return spec
    try:
        cls = backend_class(name)
    except BackendUnavailable:
        raise
    except Exception as e:  # a plugin that cannot import is unavailable, with why
        raise BackendUnavailable(f"{name}: cannot be imported: {e}") from e
    reason = cls.unavailable_reason()
    if reason:
        raise BackendUnavailable(f"{name}: {reason}")
    return spec


def device_count(name: str) -> int | None:
    """How many devices the backend can spread tensor-parallel ranks over on one host."""
    spec = resolve(name)
    if spec.builtin and name in RUN_EVERYWHERE:
        return None  # CPU cores: no limit
    return backend_class(name).device_count()


def backend_class(name: str):
    """The backend's AttentionOps class, not instantiated (its declared support is on it),
    after checking that it speaks a contract version this pagedllm runs."""
    module_name, _, attr = resolve(name).target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    check_contract(name, cls)
    return cls


def check_contract(name: str, cls) -> None:
    from .attention import AttentionOps
    from .platform import CONTRACT_VERSION, SUPPORTED_CONTRACT_VERSIONS

    if not (isinstance(cls, type) and issubclass(cls, AttentionOps)):
        raise BackendUnavailable(f"{name}: {cls!r} is not a subclass of pagedllm.backends.attention.AttentionOps")
    version = cls.contract_version
    if version not in SUPPORTED_CONTRACT_VERSIONS:
        raise BackendUnavailable(
            f"{name}: written for backend contract version {version}; this pagedllm runs versions "
            f"{', '.join(map(str, SUPPORTED_CONTRACT_VERSIONS))} (current: {CONTRACT_VERSION}; see docs/porting.md)"
        )


def load_backend(name: str):
    """Instantiate the backend's AttentionOps."""
    return backend_class(name)()


def unsupported(ops, config, wanted) -> str | None:
    """What of a model (`wanted`, a ModelConfig: the target or a draft), with the engine's
    (`config`) block size, context and KV cache dtype, the backend `ops` does not support;
    None: all of it."""
    problem = ops.unsupported(wanted.dtype, wanted.head_dim, config.block_size, config.max_model_len)
    problem = problem or ops.unsupported_features(wanted.attention_features())
    return problem or ops.unsupported_kv_cache_dtype(config.kv_cache_dtype, wanted.head_dim)
