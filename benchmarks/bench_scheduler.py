"""Scheduler step cost: schedule() + update() with N running decode requests at ~1k-token
contexts, block size 16, prefix caching on. Run:
    pytest benchmarks/bench_scheduler.py --benchmark-columns=min,median,mean,rounds
"""

import pytest

from pagedllm.core import CacheConfig, EngineRequest, SamplingParams, Scheduler, SchedulerConfig
from pagedllm.core.utils import cdiv

CONTEXT = 1000
ROUNDS = 200


def decoding_scheduler(num_requests: int) -> Scheduler:
    blocks_per_request = cdiv(CONTEXT + 4 * ROUNDS, 16)  # room for the whole run: no preemption
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=8192, max_model_len=CONTEXT + 4 * ROUNDS),
        CacheConfig(block_size=16, num_blocks=1 + num_requests * blocks_per_request),
    )
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 32000 + 10 for j in range(CONTEXT)]
        sched.add_request(
            EngineRequest(
                request_id=f"req-{i}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=4 * ROUNDS, ignore_eos=True),
            )
        )
    sampled = {f"req-{i}": 11 for i in range(num_requests)}
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        plan = sched.schedule()
        sched.update(plan, sampled)
    return sched


@pytest.mark.parametrize("num_requests", [64, 256, 1024])
def test_scheduler_decode_step(benchmark, num_requests):
    sched = decoding_scheduler(num_requests)
    sampled = {f"req-{i}": 11 for i in range(num_requests)}

    def step():
        plan = sched.schedule()
        sched.update(plan, sampled)
        return plan

    plan = benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=5)
    assert len(plan.num_scheduled_tokens) == num_requests
    sched.check_invariants()
