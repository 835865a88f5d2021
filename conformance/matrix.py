"""The support matrix: for each backend, what it declares (its platform and the ops' declared
support) and what a conformance run passed, as Markdown — in the spirit of llama.cpp's
test-backend-ops table. `pagedllm conformance --perf --json RUN.json` writes RUN.md beside it;
docs/backends.md is made from the runs at hand, and shows every other installed backend from
its declarations alone, marked as not run:

    python -m pagedllm.conformance.matrix docs/bench/conformance-cpu.json > docs/backends.md
"""

from __future__ import annotations

import argparse
import json

from pagedllm.backends.attention import ATTENTION_FEATURES, list_sizes

DTYPES = ("float32", "bfloat16", "float16")


def declarations(cls) -> dict:
    """What a backend class declares, read without instantiating it (its device may be absent)."""
    from .results import DTYPE_NAMES

    bare = cls.__new__(cls)  # properties of the platform face answer from class attributes

    def sizes(values):
        return None if values is None else list(values)

    from pagedllm.backends.attention import AttentionOps

    optional = ("set_device", "compute_threads", "default_dtype", "kv_cache_blocks", "pin_memory")
    optional += ("capture_graphs", "synchronize")
    optional += ("argmax", "apply_token_bitmask", "add_lora", "prepare_model", "quantized_linear", "copy_blocks")
    optional += ("swap_blocks",)
    return {
        "contract_version": cls.contract_version,
        # members with a default the backend replaces: its graph capture, memory query, own
        # quantized-layer kernel, ... (the rest it takes as they are)
        "overrides": [m for m in optional if getattr(cls, m) is not getattr(AttentionOps, m)],
        "device": str(bare.device),
        "kv_in_shared_memory": bool(bare.kv_in_shared_memory),
        "distributed_backend": bare.distributed_backend,
        "dtypes": [DTYPE_NAMES.get(d, str(d)) for d in cls.supported_dtypes],
        "block_sizes": sizes(cls.supported_block_sizes),
        "head_sizes": sizes(cls.supported_head_sizes),
        "max_context_len": cls.max_context_len,
        **{feature: bool(getattr(cls, f"supports_{feature}")) for feature in ATTENTION_FEATURES},
        "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
    }


def _sizes(values) -> str:
    return "any" if values is None else list_sizes(tuple(values))


def _declared_lines(d: dict) -> list[str]:
    pool = "host shared memory (survives a worker restart)" if d["kv_in_shared_memory"] else "its own device memory"
    context = "any" if d["max_context_len"] is None else f"up to {d['max_context_len']}"
    return [
        f"- contract version {d['contract_version']}; device `{d['device']}`; KV pool in {pool}; "
        f"ranks joined by {d['distributed_backend']}",
        f"- declares: dtypes {', '.join(d['dtypes'])}; block sizes {_sizes(d['block_sizes'])}; "
        f"head sizes {_sizes(d['head_sizes'])}; contexts {context}; attention features "
        f"{', '.join(f.replace('_', '-') for f in ATTENTION_FEATURES if d.get(f)) or 'none'}; "
        f"KV cache dtypes {', '.join(d.get('kv_cache_dtypes', ['auto']))}",
        f"- its own: {', '.join(d['overrides']) or 'nothing (every optional member as the base class has it)'}",
    ]


def _support_lines(support: list[dict] | None) -> list[str]:
    if not support:
        return []
    lines = ["", "| feature | supported | how |", "|---|---|---|"]
    lines += [f"| {r['feature']} | {r['supported']} | {r['how']} |" for r in support]
    return [*lines, ""]


def _speed_lines(run: dict) -> list[str]:
    if not run.get("speed"):
        return []
    machine = run.get("machine") or {}
    lines = [
        f"Speed tier (information; `--perf`{' --quick' if run.get('quick') else ''}), "
        f"{machine.get('cpu', 'machine not recorded')} ({' '.join(machine.get('vector_flags', []))}), "
        f"{machine.get('cores', '?')} cores, "
        f"load {machine.get('load', '?')}:",
        "",
        "| kernel | dtype | KV cache | requests x tokens | ms | rate | of the machine | measured peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in run["speed"]:
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['kv_cache_dtype']} | {r['shape']} | {r['ms']:.2f} | "
            f"{r['rate']} | {r['fraction']:.0%} | {r['of']} |"
        )
    return [*lines, ""]


def backend_section(name: str, declared: dict, run: dict | None, support: list[dict] | None = None) -> str:
    lines = [f"## {name}", ""]
    lines += _declared_lines(declared)
    lines += _support_lines(support if run is None else run.get("support", support))
    if run is None:
        lines += ["Not yet run here (no device for it on the machine that made this page).", ""]
        return "\n".join(lines)
    suite = ("quick" if run.get("quick") else "full") + (" ops-only" if run.get("ops_only") else "")
    tp = run.get("tensor_parallel_size", 1)
    passed = sum(c["ok"] for c in run["checks"])
    swap = next((c for c in run["checks"] if c["check"] == "preemption_swap"), None)
    swap_text = "not run" if swap is None else ("passed" if swap["ok"] else "FAILED")
    lines += [
        f"- measured: the {suite} suite, tensor parallel size {tp}: {passed} of {len(run['checks'])} checks "
        f"passed in {run['seconds']:.0f} s; preemption by swap {swap_text}",
        "",
    ]
    ops: dict[str, dict[str, str]] = {}
    lines += _speed_lines(run)
    engine = []
    for c in run["checks"]:
        mark = "skip" if c.get("skipped") else ("info" if c.get("informational") else ("pass" if c["ok"] else "FAIL"))
        base, _, dtype = c["check"].rpartition(" ")
        if dtype in DTYPES and base:
            ops.setdefault(base, {})[dtype] = f"{mark} ({c['passed']}/{c['cases']})"
        else:
            engine.append((c["check"], f"{mark} ({c['passed']}/{c['cases']})"))
    if ops:
        lines += ["| kernel check | " + " | ".join(DTYPES) + " |", "|---|" + "---|" * len(DTYPES)]
        for base, cells in ops.items():
            row = [cells.get(d, "declared, not run" if d in declared["dtypes"] else "not declared") for d in DTYPES]
            lines.append(f"| {base} | " + " | ".join(row) + " |")
        lines.append("")
    if engine:
        lines += ["| check (float32 unless its row says) | result |", "|---|---|"]
        lines += [f"| {name} | {mark} |" for name, mark in engine]
        lines.append("")
    return "\n".join(lines)


def matrix(runs: list[dict], others: dict[str, dict] | None = None) -> str:
    """Markdown: a section per run, then one per other backend from its declarations."""
    parts = [
        "# Backends: what each declares and what passed",
        "",
        "Made by `python -m pagedllm.conformance.matrix RUN.json ...` from `pagedllm conformance --perf --json` "
        "runs; each feature table is the support probe's (`pagedllm conformance --support`). Cells are "
        "(cases passed / cases); `info` marks a row shown as information (the backend does not promise what "
        "it checks, e.g. batch invariance).",
        "",
    ]
    seen = set()
    for run in runs:
        parts.append(backend_section(run["backend"], run["declared"], run))
        seen.add(run["backend"])
    for name, (declared, support) in (others or {}).items():
        if name not in seen:
            parts.append(backend_section(name, declared, None, support))
    return "\n".join(parts).rstrip() + "\n"


def installed_declarations() -> dict[str, tuple[dict, list[dict]]]:
    """Every built-in backend whose class can be imported here, by name: (its declarations, its
    support probe's rows)."""
    from pagedllm.backends.registry import available_backends, backend_class

    from .support import support_rows

    out = {}
    for name, spec in available_backends().items():
        if not spec.builtin:
            continue
        try:
            cls = backend_class(name)
            out[name] = (declarations(cls), support_rows(name, cls))
        except Exception:  # noqa: BLE001 - a backend whose module cannot import here is left out
            continue
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="JSON files written by pagedllm conformance --json")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    print(matrix(runs, installed_declarations()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
