"""Conformance results: one row per check, and the table the CLI prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from pagedllm.backends.attention import ATTENTION_FEATURES, list_sizes
from pagedllm.backends.models.config import DTYPE_NAMES

# |got - want| <= atol + rtol * |want|, per dtype (in the spirit of torch.testing's defaults)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (5e-3, 5e-3)}


def tolerance_text(dtypes) -> str:
    return "; ".join(f"{DTYPE_NAMES[d]} atol {TOLERANCES[d][0]:g} rtol {TOLERANCES[d][1]:g}" for d in dtypes)


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """(within tolerance, max abs error)."""
    atol, rtol = TOLERANCES[dtype]
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (got - want).abs()
    if not torch.isfinite(got).all():
        return False, float("inf")
    return bool((diff <= atol + rtol * want.abs()).all()), float(diff.max()) if diff.numel() else 0.0


@dataclass
class CheckResult:
    check: str
    tolerance: str = "exact"
    cases: int = 0
    passed: int = 0
    worst_error: float = 0.0
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None
    informational: bool = False  # shown, never held against the backend (it promised nothing here)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or self.informational or (self.cases > 0 and self.passed == self.cases)

    @property
    def status(self) -> str:
        if self.skipped:
            return "skip"
        if self.informational:
            return "info"
        return "PASS" if self.ok else "FAIL"

    def record(self, ok: bool, error: float = 0.0, failure: str | None = None) -> None:
        self.cases += 1
        self.worst_error = max(self.worst_error, error)
        if ok:
            self.passed += 1
        elif failure:
            self.failures.append(failure)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def declared_support(ops) -> str:
    """What the backend says it supports, and the contract version it was written for, as the
    table's header prints them."""

    def listed(values):
        return "any" if values is None else list_sizes(values)

    dtypes = ", ".join(DTYPE_NAMES.get(d, str(d)) for d in ops.supported_dtypes)
    context = "any" if ops.max_context_len is None else f"up to {ops.max_context_len}"
    features = [f.replace("_", "-") for f in ATTENTION_FEATURES if getattr(ops, f"supports_{f}")]
    return (
        f"contract version {ops.contract_version}; declared support: dtypes {dtypes}; "
        f"block sizes {listed(ops.supported_block_sizes)}; "
        f"head sizes {listed(ops.supported_head_sizes)}; context lengths {context}; "
        f"attention features {', '.join(features) or 'none'}; "
        f"KV cache dtypes {', '.join(ops.supported_kv_cache_dtypes)}"
    )


def format_table(backend: str, results: list[CheckResult], support: str | None = None) -> str:
    lines = [f"pagedllm conformance — backend {backend}"] + ([support] if support else []) + [""]
    header = f"{'check':36} {'cases':>6} {'passed':>7} {'worst error':>12}  {'status':6}  tolerance"
    lines += [header, "-" * len(header)]
    for r in results:
        err = "" if r.skipped else f"{r.worst_error:.3g}"
        lines.append(f"{r.check:36} {r.cases:>6} {r.passed:>7} {err:>12}  {r.status:6}  {r.skipped or r.tolerance}")
    failed = [r for r in results if not r.ok]
    lines.append("")
    lines.append(
        f"{sum(r.ok for r in results)} of {len(results)} checks passed"
        + ("" if not failed else f"; FAILED: {', '.join(r.check for r in failed)}")
    )
    for r in failed:
        lines.append(f"\n{r.check}:")
        lines += [f"  - {f}" for f in r.failures[:8]]
        if len(r.failures) > 8:
            lines.append(f"  ... and {len(r.failures) - 8} more")
    return "\n".join(lines)
