"""The differential test: a random workload runs together on an engine with its features on
(a small step budget, so prefills are chunked; a small pool, so requests are preempted; prefix
caching and async scheduling; n-gram speculation), and every request's tokens, logprobs and
prompt logprobs must equal those of its own run alone on an idle engine. Seeded; a failing
workload is shrunk to the fewest requests that still show the difference.

    python -m pagedllm.conformance.differential [--workloads 20] [--requests 24] [--seed 0]
        [--arch llama] [--dtype float32]

A request's output on the `cpu` backend is the same bits whatever runs beside it; a feature
that breaks that shows up here as a difference (or as a workload that never finishes).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import msgspec

from pagedllm.core.sampling_params import SamplingParams, StructuredOutputsParams

# what both engines share: the engine's shape, which may change a request's numbers (a block
# size changes how a windowed prefill walks its blocks); the rest must not
SHAPE = {"block_size": 8, "max_model_len": 256}
# the features on while the workload runs together
TOGETHER = {
    "max_num_batched_tokens": 48,
    "max_num_seqs": 8,
    "num_kv_blocks": 40,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
}
ALONE = {"enable_prefix_caching": False}
STOP_STRINGS = ("e", "o", "th", " a", "in")  # text the fixtures' byte-level tokenizers make often
CONSTRAINTS = (
    StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){1,3}"),
    StructuredOutputsParams(choice=["paged attention", "continuous batching", "a block table"]),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams


def random_workload(seed: int, count: int, vocab: int = 390, with_stops: bool = True) -> list[Request]:
    """Mixed lengths, shared prefixes, follow-up turns (an earlier prompt and more), repeats
    (speculation's proposals), n > 1, seeded sampling, stop tokens, and where the model has a
    tokenizer (`with_stops`) stop strings and structured outputs (jump-forward on); min_tokens,
    logprobs and prompt logprobs."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    out = []
    for _ in range(count):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
        if out and rng.random() < 0.2:  # a follow-up turn: its prefix-cache hit is long
            prompt = rng.choice(out).prompt + body
        else:
            prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + body
        if rng.random() < 0.3:  # a passage given twice: proposals to verify
            prompt = prompt + prompt[: rng.randrange(4, 20)]
        sampled = rng.random() < 0.4
        max_tokens = rng.randrange(1, 24)
        params = SamplingParams(
            n=2 if rng.random() < 0.2 else 1,
            temperature=0.8 if sampled else 0.0,
            top_k=20 if sampled else 0,
            seed=rng.randrange(1 << 30) if sampled else None,
            max_tokens=max_tokens,
            min_tokens=min(rng.randrange(0, 4), max_tokens),
            stop_token_ids=[rng.randrange(3, vocab)] if rng.random() < 0.3 else None,
            stop=[rng.choice(STOP_STRINGS)] if with_stops and rng.random() < 0.3 else None,
            logprobs=rng.choice([None, 0, 3]),
            prompt_logprobs=1 if rng.random() < 0.15 else None,
        )
        if with_stops and rng.random() < 0.12:  # constrained: its mask, jump-forward's forced tokens
            constraint = rng.choice(CONSTRAINTS)
            params = msgspec.structs.replace(params, min_tokens=0, structured_outputs=constraint)
        out.append(Request(prompt[:200], params))
    return out


def outputs_of(result) -> tuple:
    completions = tuple(
        (tuple(c.token_ids), c.text, repr(c.logprobs), c.finish_reason, c.stop_reason) for c in result.outputs
    )
    return completions, repr(result.prompt_logprobs)


def run_together(llm, requests: list[Request]) -> list[tuple]:
    results = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    return [outputs_of(r) for r in results]


def run_alone(llm, requests: list[Request]) -> list[tuple]:
    return [outputs_of(llm.generate([r.prompt], r.params, use_tqdm=False)[0]) for r in requests]


def differing(together: list[tuple], alone: list[tuple]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(together, alone)) if a != b]


def shrink(llm, requests: list[Request], index: int, alone_output: tuple) -> list[Request]:
    """The fewest requests (the failing one among them) that still make it differ: halves of
    the others dropped while the difference stays, then single ones."""
    probe = requests[index]
    others = requests[:index] + requests[index + 1 :]

    def still_fails(kept: list[Request]) -> bool:
        together = run_together(llm, [*kept, probe])
        return together[-1] != alone_output

    chunk = max(1, len(others) // 2)
    while chunk >= 1:
        i = 0
        while i < len(others):
            trial = others[:i] + others[i + chunk :]
            if still_fails(trial):
                others = trial
            else:
                i += chunk
        chunk //= 2
    return [*others, probe]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=int, default=20)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="llama", help="a fixture architecture (fixtures/tiny_models.py)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--window", type=int, default=None, help="the fixture's sliding window (every layer's)")
    ap.add_argument("--pool", type=int, default=TOGETHER["num_kv_blocks"], help="KV blocks while together")
    ap.add_argument("--model", default=None, help="a model folder instead of a fixture")
    args = ap.parse_args(argv)
    from pagedllm import LLM

    model = args.model
    if model is None:
        import tempfile

        from pagedllm.fixtures.tiny_models import make_model_dir

        window = {"sliding_window": args.window} if args.window else {}
        folder = f"{tempfile.gettempdir()}/pagedllm-differential-{args.arch}-w{args.window}"
        model = make_model_dir(folder, args.arch, **window)
    common = {"dtype": args.dtype, **SHAPE}
    started, failures = time.monotonic(), 0
    together_kw = {**TOGETHER, "num_kv_blocks": args.pool}
    with LLM(model, **common, **together_kw) as together_llm, LLM(model, **common, **ALONE) as alone_llm:
        for w in range(args.workloads):
            requests = random_workload(args.seed + w, args.requests)
            together, alone = run_together(together_llm, requests), run_alone(alone_llm, requests)
            bad = differing(together, alone)
            if not bad:
                continue
            failures += 1
            small = shrink(together_llm, requests, bad[0], alone[bad[0]])
            print(f"workload {args.seed + w}: {len(bad)} of {len(requests)} requests differ; smallest: {len(small)}")
            for r in small:
                print(f"  prompt {r.prompt}\n    {r.params}")
        stats = together_llm.last_stats.scheduler
    took = time.monotonic() - started
    drafts = stats.spec_decode.num_drafts if stats.spec_decode else 0
    print(
        f"together: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hits (tokens), "
        f"{drafts} proposals verified"
    )
    print(f"{args.workloads} workloads of {args.requests} requests, {failures} with a difference, {took:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
