"""`pagedllm conformance --backend NAME`: the checks a backend must pass to be a pagedllm
backend, with a table of what passed and what failed and why.

Op numerics against dense attention (block sizes, head sizes, GQA ratios, dtypes, context
lengths across block edges, shuffled tables, shared blocks); cache placement read back through
the shared-memory pool; engine behaviour (batching invariance, chunked prefill, preemption by
recompute and swap, copy-on-write after a fork, prefix-cache reuse); and end-to-end greedy
agreement with transformers on small models of every supported architecture.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import time
import traceback

from pagedllm.fixtures.tiny_models import ARCHITECTURES, make_model_dir

from .results import CheckResult, declared_support, format_table


@functools.lru_cache(maxsize=1)
def _models_root() -> str:
    root = tempfile.mkdtemp(prefix="pagedllm-conformance-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """A random-weight model folder of a fixture architecture, made once per run."""
    return make_model_dir(os.path.join(_models_root(), arch), arch)


def tiny_model_dirs() -> dict[str, str]:
    return {arch: tiny_model_dir(arch) for arch in ARCHITECTURES}


def _guarded(name: str, fn) -> list[CheckResult]:
    """A check that raises is a failed row, not a crashed suite."""
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as e:  # noqa: BLE001 - report, do not crash
        row = CheckResult(name)
        row.record(False, float("inf"), f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        return [row]


# the checks that start engines, after the op checks (op_checks.OP_CHECKS)
ENGINE_CHECKS = (
    "cache_placement",
    "memory",
    "engine behaviour",
    "end_to_end_vs_transformers",
    "invariance",
    "windowed_end_to_end",
)


def run_suite(
    backend: str,
    quick: bool = False,
    ops_only: bool = False,
    tensor_parallel_size: int = 1,
    block_placement: str = "lru",
    progress=None,
    dtypes: tuple | None = None,
    only: tuple | None = None,
) -> list[CheckResult]:
    """Every row; `progress(rows)` is called as each check finishes (a run cut short by a
    timeout has still shown what it did). dtypes: the op rows' dtypes (default: all the
    backend supports). only: these checks alone (CHECK_NAMES)."""
    from pagedllm.backends.registry import load_backend

    def run(name, make) -> list[CheckResult]:
        if only and name not in only:
            return []
        rows = _guarded(name, make)
        if progress is not None:
            progress(rows)
        return rows

    from .engine_checks import (
        check_cache_placement,
        check_end_to_end,
        check_engine_behaviour,
        check_windowed_end_to_end,
    )
    from .invariance_checks import check_invariance
    from .memory_checks import check_memory
    from .op_checks import op_checks

    ops = load_backend(backend)
    results = [row for name, make in op_checks(ops, quick, dtypes) for row in run(name, make)]
    if ops_only or (only and not set(only) & set(ENGINE_CHECKS)):
        return results
    models = tiny_model_dirs()
    results += run("cache_placement", lambda: check_cache_placement(backend, models["llama"]))
    results += run("memory", lambda: check_memory(backend, models["llama"], quick))
    results += run(
        "engine behaviour",
        lambda: check_engine_behaviour(backend, models["llama"], quick, tensor_parallel_size, block_placement),
    )
    results += run("end_to_end_vs_transformers", lambda: check_end_to_end(backend, models, quick))
    results += run(
        "invariance",
        lambda: check_invariance(backend, ops, tiny_model_dir, quick, tensor_parallel_size=tensor_parallel_size),
    )
    root = os.path.dirname(models["llama"])
    results += run("windowed_end_to_end", lambda: check_windowed_end_to_end(backend, ops, root, quick))
    return results


def main(args) -> int:
    """CLI entry: prints the table, writes --json, exits 1 if anything failed."""
    from pagedllm.backends.models.config import DTYPES
    from pagedllm.backends.registry import check_available, resolve_alias

    if args.support:
        from .support import all_support_rows, to_csv

        text = to_csv(all_support_rows())
        if args.csv:
            with open(args.csv, "w") as f:
                f.write(text)
            print(f"wrote {args.csv}")
        else:
            print(text, end="")
        return 0
    if not args.backend:
        raise SystemExit("pagedllm conformance: --backend is required (or --support)")
    args.backend, picked = resolve_alias(args.backend)
    if picked:
        print(f"pagedllm: {picked}")
    check_available(args.backend)
    if args.only:
        from pagedllm.backends.registry import load_backend

        from .op_checks import op_checks

        known = [name for name, _ in op_checks(load_backend(args.backend), True)] + list(ENGINE_CHECKS)
        unknown = [name for name in args.only if name not in known]
        if unknown:
            raise SystemExit(f"pagedllm conformance: no check {', '.join(unknown)}; the checks: {', '.join(known)}")
    t0 = time.perf_counter()

    def progress(rows) -> None:
        for r in rows:
            print(f"  {r.check}: {r.status} ({time.perf_counter() - t0:.0f} s)", flush=True)

    results = []
    if not args.perf_only:
        results = run_suite(
            args.backend,
            args.quick,
            args.ops_only,
            args.tensor_parallel_size,
            args.block_placement,
            progress=progress,
            dtypes=tuple(DTYPES[d] for d in args.dtype) if args.dtype else None,
            only=tuple(args.only) if args.only else None,
        )
    elapsed = time.perf_counter() - t0
    from pagedllm.backends.registry import backend_class

    from .matrix import backend_section, declarations
    from .support import support_rows

    cls = backend_class(args.backend)
    support = declared_support(cls)
    if not args.perf_only:
        print(format_table(args.backend, results, support))
        print(f"\n({'quick' if args.quick else 'full'}{', ops only' if args.ops_only else ''} suite, {elapsed:.0f} s)")
    speed, machine = None, None
    if args.perf or args.perf_only:
        from pagedllm.backends.host import cpu_info
        from pagedllm.backends.registry import load_backend

        from .perf import format_speed, speed_rows

        machine = {**cpu_info(), "load": round(os.getloadavg()[0], 2)}
        speed = speed_rows(load_backend(args.backend), args.quick)
        print("\n" + format_speed(args.backend, speed))
        flags = " ".join(machine["vector_flags"])
        print(f"(machine: {machine['cpu']} ({flags}), {machine['cores']} cores, load {machine['load']})")
    if args.json:
        run = {
            "backend": args.backend,
            "quick": args.quick,
            "ops_only": args.ops_only,
            "tensor_parallel_size": args.tensor_parallel_size,
            "seconds": elapsed,
            "ok": all(r.ok for r in results),
            "contract_version": cls.contract_version,
            "declared_support": support,
            "declared": declarations(cls),
            "checks": [r.to_dict() for r in results],
            "support": support_rows(args.backend, cls),
            "speed": speed,
            "machine": machine,
        }
        with open(args.json, "w") as f:
            json.dump(run, f, indent=2)
        matrix_path = os.path.splitext(args.json)[0] + ".md"  # the support matrix, beside it
        with open(matrix_path, "w") as f:
            f.write(backend_section(args.backend, run["declared"], run))
        print(f"wrote {args.json} and its support matrix {matrix_path}")
    return 0 if all(r.ok for r in results) else 1
