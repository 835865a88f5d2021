"""Structured outputs: what constraining costs and what jump-forward gains, on the demo model.

    python -m pagedllm.benchmarks.bench_structured [--requests 64] [--max-tokens 64]

- grammar compile times (llguidance) of a set of JSON schemas, a regex, a choice and a Lark
  grammar, cold and cached;
- per-step time of 64 constrained requests against 64 unconstrained ones, the same prompts and
  lengths, jump-forward off (the mask's cost alone): engine step time, and the engine core's
  part of it (step time minus the worker's forward and sampling);
- jump-forward: a key-heavy schema, output tokens/s with it on and off, and whether the outputs
  are the same token for token.
"""

from __future__ import annotations

import argparse
import statistics
import time

KEY_HEAVY = {
    "type": "object",
    "properties": {f"measurement_field_{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(10)},
    "required": [f"measurement_field_{i}" for i in range(10)],
    "additionalProperties": False,
}
# constraints that no request can finish before max_tokens, so every step is masked: a JSON
# array of at least 100 numbers (a typical schema), and 400 characters of lower-case text (a
# counting regex, whose masks cost several times more)
MASKED = {
    "json array": {
        "json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100}
    },
    "counting regex": {"regex": r"[a-z ,.]{400}"},
}


def compile_times(schemas: list[dict]) -> dict:
    from pagedllm.core.sampling_params import StructuredOutputsParams
    from pagedllm.core.scheduling.structured import Grammars
    from pagedllm.entrypoints.default_model import default_model_dir

    model = default_model_dir()
    grammars = Grammars(f"{model}/tokenizer.json", 4096, [2])
    constraints = [StructuredOutputsParams(json=s) for s in schemas] + [
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}"),
        StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
        StructuredOutputsParams(grammar='start: item ("," item)*\nitem: /[a-z]+/'),
    ]
    t0 = time.perf_counter()
    grammars.compile(constraints[0]).result()  # the tokenizer, once
    tokenizer_s = time.perf_counter() - t0
    cold, warm = [], []
    for c in constraints:
        for times in (cold, warm):
            t0 = time.perf_counter()
            grammars.compile(c).result()
            times.append(time.perf_counter() - t0)
    grammars.close()
    return {"tokenizer_ms": tokenizer_s * 1e3, "cold_ms": [t * 1e3 for t in cold], "cached_ms": [t * 1e3 for t in warm]}


def run(llm, prompts, params) -> tuple[float, float, float, int, list]:
    """(seconds, step ms, core ms a step, output tokens, outputs)."""
    before = llm.last_stats
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.last_stats
    steps = after.steps - (before.steps if before else 0)
    step_s = after.step_seconds - (before.step_seconds if before else 0)
    forward_s = after.forward_seconds - (before.forward_seconds if before else 0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, step_s / steps * 1e3, (step_s - forward_s) / steps * 1e3, tokens, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs of each configuration")
    args = ap.parse_args(argv)

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    times = compile_times([KEY_HEAVY, {"type": "array", "items": {"type": "integer"}}])
    print(
        f"grammars: tokenizer {times['tokenizer_ms']:.1f} ms once; compile "
        f"{min(times['cold_ms']):.2f}-{max(times['cold_ms']):.2f} ms, cached "
        f"{min(times['cached_ms']):.3f}-{max(times['cached_ms']):.3f} ms"
    )
    prompts = [[10 + i % 300, 11, 12, 13] for i in range(args.requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = [("unconstrained", free)] + [
        (
            name,
            SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(**c)),
        )
        for name, c in MASKED.items()
    ]
    keys = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=KEY_HEAVY))
    rows = {name: [] for name, _ in configs} | {"jump": [], "no-jump": []}
    outputs = {}
    with (
        LLM(None, max_model_len=512, jump_forward=False, skip_tokenizer_init=True) as plain,
        LLM(None, max_model_len=512, skip_tokenizer_init=True) as jumping,
    ):
        for _ in range(args.rounds):  # alternated, so that the machine's drift hits each alike
            runs = [(name, plain, params) for name, params in configs]
            runs += [("no-jump", plain, keys), ("jump", jumping, keys)]
            for name, llm, params in runs:
                seconds, step_ms, core_ms, tokens, outs = run(llm, prompts, params)
                rows[name].append((seconds, step_ms, core_ms, tokens))
                outputs[name] = [o.outputs[0].token_ids for o in outs]
    med = {k: [statistics.median(col) for col in zip(*v)] for k, v in rows.items()}
    base = med["unconstrained"][1]
    print(f"{args.requests} requests x {args.max_tokens} tokens, medians of {args.rounds}:")
    for name, _ in configs:
        step_ms, core_ms = med[name][1], med[name][2]
        print(f"  {name}: {step_ms:.2f} ms a step ({step_ms / base - 1:+.1%}), engine core {core_ms:.2f} ms")
    jump_tps, plain_tps = med["jump"][3] / med["jump"][0], med["no-jump"][3] / med["no-jump"][0]
    same = outputs["jump"] == outputs["no-jump"]
    print(
        f"  key-heavy schema: {plain_tps:.0f} output tok/s token by token, {jump_tps:.0f} with jump-forward "
        f"({jump_tps / plain_tps:.2f}x); outputs {'identical' if same else 'DIFFERENT'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
