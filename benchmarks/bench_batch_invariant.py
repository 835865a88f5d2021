"""What `--batch-invariant` costs a quantized model on the cpu backend: output tokens/s of one
request and of eight (128 tokens each, greedy, the demo model, float32 compute), int8 and
int4, with the flag against without it in the same run — the rounds alternate, and each
figure is the middle of the rounds.

Run: python -m pagedllm.benchmarks.bench_batch_invariant [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from .machine import describe, finish, machine_record

DEMO = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "demo-model")
PROMPT = "The paged attention"


def rates(mode: str, invariant: bool, tokens: int) -> tuple[float, float]:
    """(tokens/s of one request, of eight) on a fresh engine, after a warm-up request."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(DEMO, quantization=mode, batch_invariant=invariant, dtype="float32") as llm:
        llm.generate([PROMPT], params, use_tqdm=False)
        out = []
        for count in (1, 8):
            t0 = time.perf_counter()
            llm.generate([PROMPT] * count, params, use_tqdm=False)
            out.append(count * tokens / (time.perf_counter() - t0))
    return out[0], out[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)
    record = machine_record()
    runs: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for mode in ("int8", "int4"):
            for invariant in (False, True):
                runs.setdefault((mode, invariant), []).append(rates(mode, invariant, args.tokens))
    print("| mode | 1 request, tok/s | 8 requests, tok/s |\n|---|---|---|")
    for mode in ("int8", "int4"):
        base = [statistics.median(r[i] for r in runs[mode, False]) for i in (0, 1)]
        flag = [statistics.median(r[i] for r in runs[mode, True]) for i in (0, 1)]
        print(f"| {mode} | {base[0]:,.0f} | {base[1]:,.0f} |")
        print(
            f"| {mode}, `--batch-invariant` | {flag[0]:,.0f} ({flag[0] / base[0]:.2f}×) | "
            f"{flag[1]:,.0f} ({flag[1] / base[1]:.2f}×) |"
        )
    print(describe(finish(record)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
