"""The differential test: a random workload runs together on an engine with its features on
(a small step budget, so prefills are chunked; a small pool, so requests are preempted; prefix
caching and async scheduling; speculation; jump-forward), and every request's tokens, logprobs
and prompt logprobs must equal those of its own run alone on an idle, plain engine (no prefix
caching, no async scheduling, no speculation, no jump-forward, one compute thread). Seeded; a failing workload is
shrunk to the fewest requests that still show the difference; a workload that does not finish
in time is reported as a hang.

    python -m pagedllm.conformance.differential [--setting NAME ...] [--workloads 20]
        [--requests 24] [--seed 0]

Each setting fixes what both engines share (the model, its dtype, windows, the KV cache dtype,
weight quantization with --batch-invariant)
and what only the busy one does (preemption by swap, a worker killed mid-run, a draft model).
A request's output on the `cpu` backend is the same bits whatever runs beside it; a feature
that breaks that shows up here as a difference or a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec

from pagedllm.core.sampling_params import SamplingParams, StructuredOutputsParams

from .processes import worker_pids

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
# the reference: an idle, plain engine on one compute thread
ALONE = {"enable_prefix_caching": False, "async_scheduling": False, "jump_forward": False, "cpu_threads": 1}
STOP_STRINGS = ("e", "o", "th", " a", "in")  # text the fixtures' byte-level tokenizers make often
CONSTRAINTS = (
    StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){1,3}"),
    StructuredOutputsParams(choice=["paged attention", "continuous batching", "a block table"]),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
)
DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "demo-model")
DEMO_DRAFT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "demo-draft")


@dataclass(frozen=True)
class Setting:
    """What both engines share (model, dtype, window, KV cache dtype) and what only the busy
    one does (`together`: options over TOGETHER; `kills`: workers SIGKILLed mid-run)."""

    arch: str = "llama"
    dtype: str = "float32"
    window: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    batch_invariant: bool = False  # --batch-invariant (quantized layers need it)
    model: str | None = None  # a folder instead of a fixture
    together: dict = field(default_factory=dict)
    kills: int = 0


SETTINGS = {
    "dense": Setting(),
    "bfloat16": Setting(dtype="bfloat16"),
    "moe": Setting(arch="qwen3-moe", together={"num_kv_blocks": 48}),
    "windows": Setting(arch="mistral", window=12, together={"num_kv_blocks": 10}),
    "int8-kv": Setting(kv_cache_dtype="int8"),
    "int4-weights": Setting(quantization="int4", batch_invariant=True),
    "moe-bfloat16-fp8-kv": Setting(
        arch="qwen3-moe", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", together={"num_kv_blocks": 48}
    ),
    "swap": Setting(together={"preemption_mode": "swap"}),
    "worker-killed": Setting(kills=1, together={"max_worker_restarts": 100}),
    "windows-worker-killed": Setting(
        arch="mistral", window=12, kills=1, together={"num_kv_blocks": 16, "max_worker_restarts": 100}
    ),
    # a trained model quotes its prompt: n-gram proposals are accepted, runs of tokens arrive at once
    "demo": Setting(model=DEMO_MODEL),
    "draft-model": Setting(
        model=DEMO_MODEL,
        together={"speculative_config": {"method": "draft_model", "model": DEMO_DRAFT, "num_speculative_tokens": 3}},
    ),
}
QUICK = ("dense", "demo", "windows-worker-killed")  # the suite's short version (tests/test_differential.py)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    wave: int = 0  # a follow-up turn may come in a second wave, after the first has finished


def choice_tokens(tokenizer) -> list[list[int]]:
    """Each choice of the choice constraint as tokens: once its first is sampled, jump-forward
    appends the rest unsampled."""
    choices = next(c.choice for c in CONSTRAINTS if c.choice)
    return [tokenizer.encode(text, add_special_tokens=False) for text in choices]


def random_workload(
    seed: int, count: int, vocab: int = 390, with_stops: bool = True, choices: list[list[int]] | None = None
) -> list[Request]:
    """Mixed lengths, shared prefixes, follow-up turns (an earlier prompt and more), repeats
    (speculation's proposals), n > 1, beams, seeded sampling, stop tokens, and where the model
    has a tokenizer (`with_stops`) stop strings and structured outputs (jump-forward on; half
    of them a choice stopped by the first or second token of one of `choices`: a sampled stop
    token that forced tokens follow, or a forced one); min_tokens, logprobs and prompt
    logprobs."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    out = []
    for _ in range(count):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
        wave = 0
        if out and rng.random() < 0.2:  # a follow-up turn: its prefix-cache hit is long
            prompt = rng.choice(out).prompt + body
            wave = rng.randrange(2)
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
        roll = rng.random()
        if with_stops and roll < (0.2 if choices else 0.12):  # constrained: its mask, jump-forward's forced tokens
            constraint = rng.choice(CONSTRAINTS)
            params = msgspec.structs.replace(params, min_tokens=0, structured_outputs=constraint)
            if choices and rng.random() < 0.5:
                choice = next(c for c in CONSTRAINTS if c.choice)
                stop = rng.choice(rng.choice(choices)[:2])
                params = msgspec.structs.replace(params, structured_outputs=choice, stop_token_ids=[stop])
        elif roll > 0.94:  # beam search: forked sequences sharing blocks, preempted as a group
            params = SamplingParams(beam_width=2, n=2, temperature=0.0, max_tokens=min(max_tokens, 16))
            prompt = prompt[:16]  # the beams fit the smallest pool a setting runs
        out.append(Request(prompt[:200], params, wave))
    return out


def outputs_of(result) -> tuple:
    completions = tuple(
        (tuple(c.token_ids), c.text, repr(c.logprobs), c.finish_reason, c.stop_reason) for c in result.outputs
    )
    return completions, repr(result.prompt_logprobs)


class Hang(Exception):
    """The workload did not finish before its deadline: the engine stopped making progress."""


def run_together(llm, requests: list[Request], deadline_s: float = 300.0) -> list[tuple]:
    """The requests in one batch per wave; Hang if they are not all done after deadline_s (a timer
    signal interrupts the wait, so this must run on the main thread)."""

    def expired(signum, frame):
        raise Hang(f"{len(requests)} requests together were unfinished after {deadline_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, deadline_s)
    results: dict[int, tuple] = {}
    try:
        for wave in sorted({r.wave for r in requests}):
            indices = [i for i, r in enumerate(requests) if r.wave == wave]
            batch = [requests[i] for i in indices]
            outs = llm.generate([r.prompt for r in batch], [r.params for r in batch], use_tqdm=False)
            results.update(zip(indices, map(outputs_of, outs)))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return [results[i] for i in range(len(requests))]


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


class WorkerKiller(threading.Thread):
    """SIGKILLs one of the engine's workers `times` times while a workload runs, a random while
    after each replacement appeared (the core starts another; the requests must go on)."""

    def __init__(self, llm, times: int, seed: int, max_delay_s: float = 0.2):
        """max_delay_s: the longest wait before a kill (a workload computes for about a second)."""
        super().__init__(daemon=True)
        self.max_delay_s = max_delay_s
        self.llm = llm
        self.times, self.rng, self.killed = times, random.Random(seed), []
        self.stop = threading.Event()

    def run(self) -> None:
        while len(self.killed) < self.times and not self.stop.is_set():
            workers = [p for p in worker_pids(self.llm) if p not in self.killed]
            if not workers:
                time.sleep(0.02)
                continue
            if self.stop.wait(self.rng.uniform(0.0, self.max_delay_s)):
                return
            try:
                os.kill(workers[0], signal.SIGKILL)
                self.killed.append(workers[0])
            except ProcessLookupError:
                pass


def model_folder(setting: Setting) -> str:
    if setting.model is not None:
        return setting.model
    import tempfile

    from pagedllm.fixtures.tiny_models import make_model_dir

    window = {"sliding_window": setting.window} if setting.window else {}
    folder = f"{tempfile.gettempdir()}/pagedllm-differential-{setting.arch}-w{setting.window}"
    return make_model_dir(folder, setting.arch, **window)


def engines(setting: Setting, extra: dict | None = None):
    """(together, alone) LLMs for a setting; `extra`: more options for the busy one. The caller
    shuts them down."""
    from pagedllm import LLM

    model = model_folder(setting)
    common = {"dtype": setting.dtype, "kv_cache_dtype": setting.kv_cache_dtype, **SHAPE}
    if setting.quantization:
        common.update(quantization=setting.quantization, batch_invariant=setting.batch_invariant)
    together = LLM(model, **common, **{**TOGETHER, **setting.together, **(extra or {})})
    try:
        return together, LLM(model, **common, **ALONE)
    except BaseException:
        together.shutdown()
        raise


def run_setting(
    name: str, setting: Setting, workloads: int, requests: int, seed: int, extra: dict | None = None, out=print
) -> dict:
    """Runs `workloads` random workloads under one setting; returns its counts (failures: the
    workloads with a difference, each shrunk and printed; hang: the first that did not finish)."""
    started = time.monotonic()
    counts = {"setting": name, "workloads": 0, "failures": 0, "hang": None, "died": None, "kills": 0}
    together_llm, alone_llm = engines(setting, extra)
    try:
        with_stops = together_llm.tokenizer is not None
        choices = choice_tokens(together_llm.tokenizer) if with_stops else None
        vocab = 390 if setting.model is None else 2000
        for w in range(workloads):
            batch = random_workload(seed + w, requests, vocab=vocab, with_stops=with_stops, choices=choices)
            alone_started = time.monotonic()
            alone = run_alone(alone_llm, batch)
            deadline_s = 30 + 10 * (time.monotonic() - alone_started)  # a busy engine is not 10x slower
            # the first workload's worker dies at once (a kill is sure to land), later ones mid-run
            killer = WorkerKiller(together_llm, setting.kills, seed + w, 0.2 if w else 0.0) if setting.kills else None
            if killer is not None:
                killer.start()
            try:
                together = run_together(together_llm, batch, deadline_s)
            except Hang as e:
                counts["hang"] = f"workload {seed + w}: {e}"
                out(f"[{name}] HANG {counts['hang']}")
                break
            except Exception as e:  # noqa: BLE001 - the engine died: the setting failed
                counts["died"] = f"workload {seed + w}: {type(e).__name__}: {str(e)[:300]}"
                out(f"[{name}] DIED {counts['died']}")
                break
            finally:
                if killer is not None:
                    killer.stop.set()
                    killer.join()
                    counts["kills"] += len(killer.killed)
            counts["workloads"] += 1
            bad = differing(together, alone)
            if not bad:
                continue
            counts["failures"] += 1
            small = shrink(together_llm, batch, bad[0], alone[bad[0]]) if not setting.kills else [batch[bad[0]]]
            out(f"[{name}] workload {seed + w}: {len(bad)} of {len(batch)} requests differ; smallest: {len(small)}")
            for r in small:
                out(f"  prompt {r.prompt}\n    {r.params}")
            (got, *_), (want, *_) = together[bad[0]][0], alone[bad[0]][0]
            out(f"  together: tokens {list(got[0])} {got[3:]}\n  alone:    tokens {list(want[0])} {want[3:]}")
        stats = together_llm.last_stats.scheduler if together_llm.last_stats else None
    finally:
        try:
            together_llm.shutdown()
        finally:
            alone_llm.shutdown()
    if stats is not None:
        counts.update(
            preemptions=stats.num_preemptions,
            prefix_hits=stats.prefix_cache_hits,
            proposals=stats.spec_decode.num_drafts if stats.spec_decode else 0,
            accepted=stats.spec_decode.num_accepted_tokens if stats.spec_decode else 0,
        )
    counts["seconds"] = round(time.monotonic() - started, 1)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", choices=list(SETTINGS), help="repeatable (default: all)")
    ap.add_argument("--workloads", type=int, default=20, help="per setting")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--option", action="append", default=[], metavar="NAME=JSON", help="an engine option for the busy engine"
    )
    args = ap.parse_args(argv)
    extra = {}
    for item in args.option:
        key, _, value = item.partition("=")
        extra[key] = json.loads(value)
    bad = 0
    for name in args.setting or list(SETTINGS):
        counts = run_setting(name, SETTINGS[name], args.workloads, args.requests, args.seed, extra)
        print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
        bad += counts["failures"] + (counts["hang"] is not None) + (counts["died"] is not None)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
