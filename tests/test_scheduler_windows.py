"""The core with a sliding window on every layer: blocks behind the window go back to the pool
(and into the prefix cache), so a pool may be smaller than max_model_len. A follow-up turn that
hits its whole history in the prefix cache must still start, and a worker restart under async
scheduling must never leave a query reading a block already released. The fake worker reads
only each query's window and checks every slot it reads."""

import pytest

from pagedllm.core.config import CacheConfig, SchedulerConfig, check_fits
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.utils import cdiv

from core_helpers import FakeWorker, add, make_scheduler, next_step, run_to_completion


def smallest_pool(block_size: int, window: int, budget: int, max_model_len: int) -> int:
    """The fewest blocks (null block included) check_fits accepts for this configuration."""
    for num_blocks in range(2, cdiv(max_model_len, block_size) + 2):
        try:
            check_fits(
                CacheConfig(block_size=block_size, num_blocks=num_blocks, sliding_window=window),
                SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len),
            )
            return num_blocks
        except InvalidParameter:
            continue
    raise AssertionError("no pool fits")


@pytest.mark.parametrize("block_size,window,budget", [(4, 3, 4), (4, 6, 8), (2, 5, 3), (8, 13, 8), (4, 1, 5)])
@pytest.mark.parametrize("extra_blocks", [0, 1, 3])
def test_a_follow_up_turn_that_hits_its_whole_history_starts_in_any_pool_the_engine_accepts(
    block_size, window, budget, extra_blocks
):
    """Turn one's blocks all stay in the prefix cache (the pool holds them, free); turn two is
    turn one's prompt and answer and more. Its hits behind the window are not needed by any
    query, so they are neither revived nor counted: it starts, and reads the right tokens. A
    request waiting behind it starts too."""
    max_model_len = 64
    num_blocks = smallest_pool(block_size, window, budget, max_model_len) + extra_blocks
    usable = num_blocks - 1
    sched = make_scheduler(
        block_size=block_size,
        num_blocks=num_blocks,
        budget=budget,
        max_model_len=max_model_len,
        sliding_window=window,
    )
    worker = FakeWorker(block_size, num_blocks, window=window)
    first_len = usable * block_size - 3  # turn one's prompt and answer fill the pool's blocks, all but the last
    prompt = [(7 * i) % 50 + 2 for i in range(first_len)]
    add(sched, "turn1", prompt, max_tokens=3)
    outputs, _, _ = run_to_completion(sched, worker)
    history = prompt + outputs["turn1"]
    assert sched.kv.pool.num_cached_free >= len(history) // block_size - 1
    follow_up = history + [(3 * i) % 50 + 2 for i in range(min(3 * block_size, max_model_len - len(history) - 5))]
    assert cdiv(len(follow_up), block_size) > usable, "turn two's whole context would not fit the pool"
    add(sched, "turn2", follow_up, max_tokens=4)
    add(sched, "behind", [5, 6, 7], max_tokens=2)
    outputs, reasons, _ = run_to_completion(sched, worker, max_steps=200)
    assert reasons == {"turn2": "length", "behind": "length"}
    assert sched.kv.pool.num_used == 0


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("prompt_len", [9, 10, 11, 12])
def test_a_worker_restart_under_async_scheduling_never_leaves_a_query_on_a_released_block(caching, prompt_len):
    """The step planned ahead releases the blocks behind its own window; undone by a restart,
    the step planned again starts a token (or a prefill's last chunk) earlier, where the block
    is gone. Every crash point of a run: the fake worker reads each query's whole window."""
    window, block_size = 5, 4
    for crash_at in range(24):
        sched = make_scheduler(
            block_size=block_size,
            num_blocks=12,
            budget=8,
            max_model_len=64,
            sliding_window=window,
            enable_prefix_caching=caching,
        )
        worker = FakeWorker(block_size, 12, window=window)
        add(sched, "a", range(2, 2 + prompt_len), max_tokens=20)
        add(sched, "b", range(30, 30 + prompt_len - 3), max_tokens=18)
        in_flight = []
        outputs = {}
        for step in range(200):
            if not in_flight and not sched.has_unfinished_requests():
                break
            plan, _ = next_step(sched, in_flight, async_scheduling=True)
            if plan is None:
                continue
            if step == crash_at:  # the workers die in this step: it and the one planned ahead are undone
                failed, in_flight = [plan, *in_flight], []
                sched.recover(failed, kv_lost=False)
                worker.restart()
                continue
            for out in sched.update(plan, worker.execute(plan), worker.logprobs):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            sched.check_invariants()
        assert {rid: len(t) for rid, t in outputs.items()} == {"a": 20, "b": 18}, crash_at
        assert sched.kv.pool.num_used == 0
