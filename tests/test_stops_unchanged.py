"""Stops where features meet them: jump-forward (the grammar's forced tokens join a request in
one delta) and speculative decoding (a verified run arrives as one delta) must end a request
exactly where plain decoding ends it. Many random stops — stop token ids, stop strings,
min_tokens, max_tokens, EOS — drawn from what plain decoding writes, so that they hit inside
forced and verified runs, some requests with a logit_bias (which verification must see as
sampling does); text, token ids, logprobs, finish and stop reasons compared."""

from __future__ import annotations

import random

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.benchmarks.bench_speculative import quoting_prompts

KEYS = {f"measurement_field_{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(4)}
SCHEMA = {"type": "object", "properties": KEYS, "required": list(KEYS), "additionalProperties": False}
ENGINE = dict(max_model_len=512, max_num_batched_tokens=256)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
FEATURES = {
    "jump-forward": dict(jump_forward=True),
    "speculation": dict(jump_forward=False, speculative_config=NGRAM),
    "both": dict(jump_forward=True, speculative_config=NGRAM),
}


def workload(reference: list, prompts: list[str], constrained: list[bool], tokenizer, seed: int = 0, count: int = 48):
    """Requests whose stops are drawn from the reference outputs (greedy, no stops): a token id
    or a string from somewhere in the output, a string just before min_tokens, a length limit;
    then, for each free-text prompt, a stop string in each of its first tokens with min_tokens
    a token or two past it (a verified run that holds both must not end at the string)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        p = i % len(prompts)
        out = reference[p]
        tokens, text = out.token_ids, out.text
        kinds = rng.sample(["token", "string", "min_tokens", "max_tokens", "eos"], k=rng.randrange(1, 4))
        params = dict(temperature=0, max_tokens=len(tokens), ignore_eos="eos" not in kinds)
        if "token" in kinds:
            params["stop_token_ids"] = [tokens[rng.randrange(1, len(tokens))], *rng.sample(tokens, k=rng.randrange(2))]
        if "min_tokens" in kinds and not constrained[p]:  # (refused with a grammar: it decides the end)
            params["min_tokens"] = rng.randrange(1, len(tokens))
        if "string" in kinds:
            # somewhere in the text, or (with min_tokens) in the few tokens before min_tokens
            first = params.get("min_tokens", 0) - rng.randrange(1, 5) if "min_tokens" in params else None
            if first is None or first < 0:
                start = rng.randrange(0, len(text) - 1)
            else:
                start = len(tokenizer.decode(tokens[:first]))
            params["stop"] = [text[start : start + rng.randrange(1, 7)] or text[-1]]
        if "max_tokens" in kinds:
            params["max_tokens"] = rng.randrange(max(1, params.get("min_tokens", 1)), len(tokens) + 1)
        if rng.random() < 0.25:
            params["logprobs"] = 2  # (jump-forward is off for such a request: it has no forced logprobs)
        if rng.random() < 0.3:  # a bias on tokens the output has, and on others; verification sees it too
            chosen = rng.sample(tokens, k=2) + [rng.randrange(3, 4096)]
            params["logit_bias"] = {t: rng.choice([-100.0, -3.5, 2.0, 8.0]) for t in chosen}
        if constrained[p]:
            params["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
        requests.append((prompts[p], SamplingParams(**params)))
    for p, out in enumerate(reference):  # a stop string in each of the tokens just before min_tokens
        for m in range(2, 10) if not constrained[p] else ():
            start = len(tokenizer.decode(out.token_ids[: m - 2]))
            stop = out.text[start : len(tokenizer.decode(out.token_ids[: m - 1]))].strip() or out.text[start]
            requests.append((prompts[p], SamplingParams(temperature=0, max_tokens=40, min_tokens=m, stop=[stop])))
    return requests


def run(llm: LLM, requests, batch: int = 8) -> list:
    """In batches small enough that speculation stays on (it stops above 16 running)."""
    outs = []
    for i in range(0, len(requests), batch):
        part = requests[i : i + batch]
        outs += llm.generate([p for p, _ in part], [s for _, s in part], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def comparable(out) -> tuple:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [sorted((t, lp.logprob, lp.rank) for t, lp in entry.items()) for entry in out.logprobs]
    return out.text, list(out.token_ids), out.finish_reason, out.stop_reason, logprobs


def test_random_stops_end_requests_where_plain_decoding_ends_them():
    """The demo model on text that quotes itself (n-gram proposals are kept, several tokens a
    step) and on a JSON schema of long fixed keys (the grammar forces most tokens)."""
    prompts = quoting_prompts(4, chars=300) + ["Answer in JSON.", "The dictionary"]
    constrained = [False] * 4 + [True] * 2
    with LLM(None, **ENGINE, jump_forward=False) as llm:
        free = dict(temperature=0, max_tokens=60, ignore_eos=True)
        json = StructuredOutputsParams(json=SCHEMA)
        references = [
            (p, SamplingParams(**free, structured_outputs=json if c else None)) for p, c in zip(prompts, constrained)
        ]
        requests = workload(run(llm, references), prompts, constrained, llm.get_tokenizer())
        plain = [comparable(o) for o in run(llm, requests)]
    reasons = {(o[2], o[3] is not None) for o in plain}
    assert {("stop", True), ("length", False)} <= reasons, reasons  # stops hit, and some run to length
    differences = []
    for feature, options in FEATURES.items():
        with LLM(None, **ENGINE, **options) as llm:
            got = [comparable(o) for o in run(llm, requests)]
            stats = llm.last_stats.scheduler
        if "speculative_config" in options:
            assert stats.spec_decode.num_accepted_tokens > 0, "nothing was kept: no run of several tokens"
        for i, (a, b) in enumerate(zip(got, plain)):
            if a != b:
                differences.append(f"{feature}: request {i} {requests[i][1]}\n with: {a[:4]}\n without: {b[:4]}")
    assert not differences, f"{len(differences)} differ:\n" + "\n".join(differences)
