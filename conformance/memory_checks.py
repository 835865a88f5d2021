"""The memory tier: does the backend account its memory honestly, inside the real engine?

- memory_pool_sized: the engine starts with the pool the backend sizes (its memory query, or
  --kv-cache-memory where it has none), a request runs in it, and a pool kept in shared memory
  is as large as the blocks it reports.
- memory_every_block_used: requests that hold every usable block of a small pool at once are
  served; run again with prefix caching, every full block is read back (a hit) and gives the
  same tokens and logprobs.
- memory_nothing_left: after requests of mixed lengths, forks, beams and preemption, no block
  is held, nothing waits, and no shared-memory segment was added.
- memory_worker_restart: a worker killed and replaced gives back the same number of blocks,
  and the pool is whole again once its requests end.
"""

from __future__ import annotations

import os
import signal
import time

from pagedllm.core.process import shm
from pagedllm.core.sampling_params import SamplingParams

from .engine_checks import random_prompts
from .processes import worker_pids
from .results import CheckResult

SMALL_POOL = 49  # blocks of 16 tokens, the null block included: 48 usable, 12 requests of 4
SHAPE = {"block_size": 16, "max_model_len": 256, "dtype": "float32"}


def _outputs(results) -> list:
    return [[(c.token_ids, repr(c.logprobs)) for c in r.outputs] for r in results]


def _idle(stats) -> str | None:
    """Why the engine is not back to an empty pool, or None."""
    s = stats.scheduler
    if s.num_running or s.num_waiting or s.num_swapped:
        return f"{s.num_running} running, {s.num_waiting} waiting, {s.num_swapped} swapped after every request ended"
    if s.kv_cache_usage:
        held = round(s.kv_cache_usage * (s.num_blocks - 1))
        return f"{held} of {s.num_blocks - 1} blocks still held after every request ended"
    return None


def check_memory(backend: str, model: str, quick: bool) -> list[CheckResult]:
    from pagedllm.entrypoints.llm import LLM

    rows = {name: CheckResult(name) for name in ("memory_pool_sized", "memory_every_block_used")}
    rows |= {name: CheckResult(name) for name in ("memory_nothing_left", "memory_worker_restart")}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)

    # the backend's own sizing (a port's memory query); the cpu backend's --kv-cache-memory
    sizing = {"kv_cache_memory": "64MiB"} if quick else {}
    with LLM(model, backend=backend, skip_tokenizer_init=True, **SHAPE, **sizing) as llm:
        ready = llm.engine.ready
        llm.generate([random_prompts(1, 0, 40, 40)[0]], greedy, use_tqdm=False)
        problem = _idle(llm.last_stats) or (None if ready.num_blocks > 1 else f"a pool of {ready.num_blocks} blocks")
        for name in filter(None, ready.kv_segments):
            size = os.stat(os.path.join(shm.SHM_DIR, name)).st_size if os.path.isdir(shm.SHM_DIR) else None
            if size is not None and size < ready.num_blocks:  # a byte a block at the very least
                problem = f"segment {name} holds {size} bytes for {ready.num_blocks} blocks"
        rows["memory_pool_sized"].record(problem is None, failure=problem)

    small = {"num_kv_blocks": SMALL_POOL, "max_num_batched_tokens": 2048, "max_num_seqs": 64}
    with LLM(model, backend=backend, skip_tokenizer_init=True, enable_prefix_caching=True, **SHAPE, **small) as llm:
        segments = set(shm.segments_of(llm.engine.pid))
        usable = llm.engine.ready.num_blocks - 1
        # every usable block at once: three blocks of prompt each, and a fourth for its tokens
        per_request = 4  # blocks: 3 of prompt, 1 for the tokens it makes
        count = usable // per_request
        prompts = random_prompts(count, 1, 48, 48)
        first = llm.generate(prompts, greedy, use_tqdm=False)
        peak = llm.last_stats.scheduler.peak_blocks_used
        hits_before = llm.last_stats.scheduler.prefix_cache_hits
        again = llm.generate(prompts, greedy, use_tqdm=False)
        read_back = llm.last_stats.scheduler.prefix_cache_hits - hits_before
        problem = None
        if peak < usable:
            problem = f"at most {peak} of {usable} blocks were held at once; the fill did not happen"
        elif _outputs(again) != _outputs(first):
            problem = "the requests read back from cached blocks gave other tokens or logprobs"
        elif read_back < count * 32:  # each prompt's first two full blocks are cached ahead of its last token
            problem = f"only {read_back} tokens were read back from the cache"
        rows["memory_every_block_used"].record(problem is None, failure=problem)

        # mixed lengths, forks (n = 2, beams) and preemption in the small pool
        mixed = random_prompts(12 if quick else 32, 2, 1, 150)
        params = [
            SamplingParams(temperature=0, max_tokens=8 + i % 20, ignore_eos=True, n=1 + (i % 4 == 0))
            if i % 7
            else SamplingParams(beam_width=2, temperature=0, max_tokens=6)
            for i in range(len(mixed))
        ]
        llm.generate([p[:60] if params[i].beam_width else p for i, p in enumerate(mixed)], params, use_tqdm=False)
        problem = _idle(llm.last_stats)
        if problem is None and set(shm.segments_of(llm.engine.pid)) != segments:
            problem = f"shared-memory segments changed: {sorted(segments)} -> {shm.segments_of(llm.engine.pid)}"
        if problem is None and not llm.last_stats.scheduler.num_preemptions:
            problem = "the pool forced no preemption: nothing was tested"
        rows["memory_nothing_left"].record(problem is None, failure=problem)

        blocks = llm.last_stats.scheduler.num_blocks
        victims = worker_pids(llm)
        problem = None
        if not victims:
            problem = "no local worker process to stop"
        else:
            os.kill(victims[0], signal.SIGKILL)
            time.sleep(0.2)
            llm.generate(mixed[:8], params[1:7] + params[8:10], use_tqdm=False)
            stats = llm.last_stats.scheduler
            if stats.num_blocks != blocks:
                problem = f"{stats.num_blocks} blocks after the worker was replaced, {blocks} before"
            else:
                problem = _idle(llm.last_stats)
            if problem is None and worker_pids(llm) == victims:
                problem = "the worker was not replaced"
        rows["memory_worker_restart"].record(problem is None, failure=problem)
    return list(rows.values())
