"""Results of `pagedllm bench`: token accounting, the terminal table, JSON and PNG plots."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class SystemResult:
    name: str
    seconds: float
    requested_tokens: int
    useful_tokens: int  # per request, at most what it asked for
    short_requests: int  # requests that returned fewer tokens than asked: flagged, not rewarded
    prompt_tokens: int
    agreement: float | None = None  # share of requests whose tokens equal pagedllm's
    extra: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.useful_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.useful_tokens + self.prompt_tokens) / self.seconds


def account(
    name: str, seconds: float, prompts: list[list[int]], max_tokens: list[int], outputs: list[list[int]]
) -> SystemResult:
    """Count only the tokens each request asked for; a request that came back short counts
    what it returned and is flagged."""
    useful = sum(min(len(o), m) for o, m in zip(outputs, max_tokens))
    short = sum(len(o) < m for o, m in zip(outputs, max_tokens)) + max(0, len(max_tokens) - len(outputs))
    return SystemResult(name, seconds, sum(max_tokens), useful, short, sum(map(len, prompts)))


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The share of the reference's tokens that the other run's greedy outputs repeat, each
    request counted up to where the two first differ (after that they continue different texts;
    on random weights a near-tie anywhere ends the count)."""
    same = sum(
        next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b))) for a, b in zip(reference, other)
    )
    return same / max(sum(map(len, reference)), 1)


# bytes a weight of the decoder layers' projections, per weight format (int8: a scale a row;
# int4: a scale per group of 128, ~1%: both left out)
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int4": 0.5}


def weight_bytes_per_token(config: dict, dtype: str, quantization: str | None = None) -> float:
    """The bytes of weights one decode step of one request reads, from a Llama-family
    config.json: every projection of every layer (quantized ones at their own width) and the LM
    head (in `dtype`); the embedding's one row and the norms are left out."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    experts = config.get("num_experts_per_tok", 1)  # a mixture reads the experts it routes to
    mlp = 3 * hidden * config["intermediate_size"] * experts
    layers = config["num_hidden_layers"] * (attention + mlp)
    return layers * WEIGHT_BYTES[quantization or dtype] + config["vocab_size"] * hidden * WEIGHT_BYTES[dtype]


def bandwidth_lines(results: list[SystemResult], bytes_per_token: float, probe_gb_s: float) -> list[str]:
    """For a one-request run: each system's rate of reading the weights, and its share of the
    machine probe's all-thread bandwidth (the yardstick of a decode bound by memory)."""
    lines = [f"weights read a token: {bytes_per_token / 1e6:.1f} MB; the probe's bandwidth: {probe_gb_s} GB/s"]
    for r in results:
        rate = bytes_per_token * r.output_tok_s / 1e9
        lines.append(f"  {r.name}: {rate:.1f} GB/s of weights, {rate / probe_gb_s:.0%} of the probe's")
    return lines


def format_table(results: list[SystemResult]) -> str:
    base = results[0]
    head = f"{'system':42} {'out tok/s':>10} {'total tok/s':>12} {'pagedllm is':>12} {'greedy agreement':>17}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = "" if r is base else f"{base.output_tok_s / r.output_tok_s:.2f}x"
        agree = "" if r.agreement is None else f"{r.agreement:.0%}"
        note = f"FLAGGED: {r.short_requests} requests returned fewer tokens than asked" if r.short_requests else ""
        lines.append(f"{r.name:42} {r.output_tok_s:10.0f} {r.total_tok_s:12.0f} {ratio:>12} {agree:>17}  {note}")
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def _figure(ncols: int = 1, figsize=(7, 3.5)):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    return fig, axes


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(path: str, results: list[SystemResult], title: str) -> None:
    fig, ax = _figure()
    names = [r.name for r in results]
    rates = [r.output_tok_s for r in results]
    bars = ax.barh(names[::-1], rates[::-1], color=["#4C72B0"] * (len(names) - 1) + ["#DD8452"])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens / s (requested tokens only)")
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def plot_kv_usage(path: str, series: list[tuple[int, int, int]], block_size: int) -> None:
    fig, ax = _figure()
    steps = range(len(series))
    ax.plot(steps, [s[0] for s in series], label="live tokens", lw=1.2)
    ax.plot(steps, [s[1] for s in series], label=f"paged: slots in held blocks (block {block_size})", lw=1.2)
    ax.plot(steps, [s[2] for s in series], label="contiguous: max_model_len per request", lw=1.2)
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV slots")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    _save(fig, path)


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of durations, in milliseconds (NaN when there are none)."""
    import numpy as np

    if not seconds:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def plot_latency(path: str, rows: list[dict]) -> None:
    fig, axes = _figure(2, figsize=(8, 3.2))
    rates = [r["rate"] for r in rows]
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for q in ("p50", "p90", "p99"):
            ax.plot(rates, [r[key][q] for r in rows], marker="o", label=q)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_scaling(path: str, rows: list[dict]) -> None:
    fig, ax = _figure(figsize=(6, 3.2))
    ax.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (max_num_seqs)")
    ax.set_ylabel("output tokens / s")
    _save(fig, path)


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
