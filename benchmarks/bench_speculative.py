"""Speculative decoding (n-gram prompt lookup, and the demo model's shipped one-layer draft)
on the demo model: one request alone, and 64 at once, with and without speculation, engines
alternated round by round so that the machine's drift hits each alike. The workload quotes
its input: a held-out pydoc passage, given twice, then its start once more, to be continued
(greedy, 256 tokens).

Run: python -m pagedllm.benchmarks.bench_speculative [--rounds 3] [--tokens 256] [--model FOLDER]
(--model: another target with the demo model's tokenizer, e.g. one trained further by
tools/train_demo_model.py; the draft stays the shipped demo draft)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

from pagedllm import LLM, SamplingParams

from .machine import describe, finish, machine_record

CONFIGS = {
    "none": None,
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "draft k=2": {"model": "demo-draft", "num_speculative_tokens": 2},
    "draft k=4": {"model": "demo-draft", "num_speculative_tokens": 4},
}


def quoting_prompts(count: int, chars: int = 400) -> list[str]:
    """Passages of `chars` characters from the held-out topics, each as the training tool's
    quoting_prompt (twice, then its first quarter, cut before a space). At 400, ~230 prompt
    tokens: with 256 to generate, within the demo model's 512 positions."""
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "train_demo_model.py")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    texts = [t for t in script.held_out_texts() if len(t) >= 700]
    passages = [texts[i % len(texts)][:chars] for i in range(count)]
    return [script.quoting_prompt(p) for p in passages]


def quoted_share(prompt: list[int], output: list[int], n: int = 5) -> tuple[int, int]:
    """Of the output's tokens: how many end an n-gram the prompt has (the output quotes its input
    there), and how many end one that only the output had before (it repeats itself: a loop,
    which n-gram lookup predicts as well)."""
    in_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    seq, seen, quoted, looped = prompt + output, set(), 0, 0
    for end in range(len(prompt), len(seq)):
        gram = tuple(seq[end - n + 1 : end + 1])
        quoted += gram in in_prompt
        looped += gram not in in_prompt and gram in seen
        seen.add(gram)
    return quoted, looped


def run(engines: dict, prompts: list[str], params: SamplingParams, rounds: int) -> tuple[dict, list]:
    """Each engine's median output tok/s over the rounds, and the last round's outputs of the
    first engine."""
    rates = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            # what was generated: a request stops early where the model's length ends
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            if name == next(iter(engines)):
                first = outs
    return {name: statistics.median(r) for name, r in rates.items()}, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", help="the target model's folder (default: the demo model)")
    args = ap.parse_args(argv)
    record = machine_record()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines = {name: LLM(args.model, speculative_config=cfg, kv_cache_memory="256MiB") for name, cfg in CONFIGS.items()}
    try:
        for llm in engines.values():  # warm-up
            llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
        single, _ = run(engines, quoting_prompts(1), params, args.rounds)
        stats = {name: llm.last_stats.scheduler.spec_decode for name, llm in engines.items()}
        batched, outputs = run(engines, quoting_prompts(64), params, max(1, args.rounds // 2))
    finally:
        for llm in engines.values():
            llm.shutdown()
    print(f"demo model, greedy, {args.tokens} tokens a request, output tok/s (median of the rounds):")
    print(f"  {'speculation':12} {'1 request':>10} {'x none':>7} {'64 requests':>12} {'x none':>7}  acceptance")
    for name in CONFIGS:
        s = stats[name]
        rate = "" if s is None else f"{s.num_accepted_tokens / max(s.num_draft_tokens, 1):.0%} of proposed"
        rate += "" if s is None else f" ({s.num_accepted_tokens / max(s.num_drafts, 1):.2f} a proposal)"
        print(
            f"  {name:12} {single[name]:10.0f} {single[name] / single['none']:6.2f}x {batched[name]:12.0f} "
            f"{batched[name] / batched['none']:6.2f}x  {rate}"
        )
    shares = [quoted_share(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"the 64 outputs without speculation: {sum(q for q, _ in shares) / total:.0%} of their tokens end a 5-gram "
        f"of the prompt (quoted), {sum(r for _, r in shares) / total:.0%} one only the output had before (looped)"
    )
    print(describe(finish(record)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
