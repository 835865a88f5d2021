"""The scheduler's corner cases, each run the way the engine core runs plans: a plan that
`is_empty` never reaches the workers, so whatever it carried (preemptions, swap-outs, ended
requests) must make it non-empty."""

import numpy as np
import pytest

from pagedllm.core import InvalidParameter

from core_helpers import FakeWorker, add, make_scheduler, next_step, run_to_completion


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_step_that_only_preempts_reaches_the_workers(mode):
    """An n > 1 request of one prompt token forks without computing anything; under the
    priority policy it first preempts the running request that holds the only other sequence
    slot. The step computes no token, but the worker must drop (or swap out) the victim."""
    sched = make_scheduler(
        block_size=4,
        num_blocks=20,
        max_num_seqs=2,
        max_model_len=32,
        policy="priority",
        preemption_mode=mode,
        num_swap_blocks=16 if mode == "swap" else 0,
    )
    worker = FakeWorker(4, 20, 16 if mode == "swap" else 0)
    add(sched, "low", range(1, 10), max_tokens=6, priority=5)
    add(sched, "other", range(11, 14), max_tokens=3, priority=5)
    plan, _ = next_step(sched, [], False)
    first = {o.request_id: o.new_token_ids for o in sched.update(plan, worker.execute(plan))}
    add(sched, "high", [30], max_tokens=4, n=2, priority=0)
    plan = sched.schedule()
    assert plan.total_num_scheduled_tokens == 0 and sorted(plan.preempted_request_ids) == ["low", "other"]
    assert not plan.is_empty, "the victims' state would stay with the worker"
    if mode == "swap":
        assert plan.swap_out
    sched.update(plan, worker.execute(plan))
    outputs, _, _ = run_to_completion(sched, worker)  # the FakeWorker checks every KV slot read
    for rid, tokens in first.items():
        outputs[rid] = tokens + outputs[rid]
    assert {rid: len(t) for rid, t in outputs.items()} == {"high": 4, "high#1": 4, "low": 6, "other": 3}


def test_priority_preemption_counts_a_victims_prefix_hits_once():
    """The head shares two cached blocks with the low-priority request that alone holds them.
    Preempting it frees those blocks and the head revives them: counted as freed and not as
    needed, the check would preempt for a head that still cannot start."""
    sched = make_scheduler(block_size=4, num_blocks=6, max_num_seqs=4, max_model_len=16, policy="priority")
    worker = FakeWorker(4, 6)
    add(sched, "low", range(1, 8), max_tokens=6, priority=5)  # 7 prompt tokens
    add(sched, "mid", range(40, 45), max_tokens=8, priority=0)  # of the head's priority: no victim
    for _ in range(3):  # "low" then holds three blocks (two full), "mid" two; their next decodes need none
        plan = sched.schedule()
        sched.update(plan, worker.execute(plan))
    low, mid = sched.requests["low"], sched.requests["mid"]
    assert sched.kv.pool.num_free == 0 and sched.kv.num_blocks_of(low) == 3 and sched.kv.num_blocks_of(mid) == 2
    # 8 shared tokens and 5 more: 4 blocks, the two shared and two fresh; "low"'s 3 are too few
    add(sched, "high", list(low.all_token_ids[:8]) + [50, 51, 52, 53, 54], max_tokens=2, priority=0)
    plan = sched.schedule()
    assert sched.num_preemptions == 0, "preempted for a head that could not start"
    assert sorted(plan.num_scheduled_tokens) == ["low", "mid"]


def test_pending_forks_and_swapped_requests_stay_within_max_num_seqs():
    sched = make_scheduler(
        block_size=4, num_blocks=12, max_num_seqs=3, max_model_len=32, preemption_mode="swap", num_swap_blocks=40
    )
    worker = FakeWorker(4, 12, 40)
    add(sched, "a", range(1, 10), max_tokens=12, n=2)
    add(sched, "b", range(20, 25), max_tokens=12)
    add(sched, "c", range(30, 35), max_tokens=12)
    peak = 0
    in_flight = []
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        plan, _ = next_step(sched, in_flight, False)
        peak = max(peak, len(sched.running) + sum(r.forks_pending for r in sched.running))
        if plan is not None:
            sched.update(plan, worker.execute(plan))
        sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert peak <= 3


def test_aborting_n_samples_before_they_fork_ends_every_one():
    sched = make_scheduler(block_size=4, budget=4)
    add(sched, "r", range(1, 30), max_tokens=4, n=3)
    sched.schedule()  # a first chunk of the prompt: nothing forked yet
    out = sched.abort_requests(["r", "r#1", "r#2"])
    assert sorted((o.request_id, o.finish_reason) for o in out) == [("r", "abort"), ("r#1", "abort"), ("r#2", "abort")]
    assert not sched.has_unfinished_requests()


def test_a_beam_search_wider_than_the_token_budget_is_refused():
    sched = make_scheduler(budget=4, max_num_seqs=8)
    with pytest.raises(InvalidParameter, match="max_num_batched_tokens") as e:
        add(sched, "wide", [1, 2, 3], max_tokens=4, beam_width=5)
    assert e.value.field == "beam_width"
    add(sched, "fits", [1, 2, 3], max_tokens=4, beam_width=4)


def test_an_error_in_one_beam_search_ends_it_alone(monkeypatch):
    """A search whose step raises (the OverflowError an unbounded length_penalty gave) is ended
    with its blocks freed and reported; the request beside it goes on to the end."""
    from pagedllm.core.scheduling.beam_search import BeamGroup

    def overflow(self, candidates, histories):
        raise OverflowError("(34, 'Numerical result out of range')")

    sched = make_scheduler(block_size=4, num_blocks=40)
    worker = FakeWorker(4, 40)
    add(sched, "beams", [1, 2, 3], max_tokens=6, beam_width=2)
    add(sched, "plain", [4, 5, 6], max_tokens=6)
    plan = sched.schedule()  # the beam's prompt but its last token; "plain"'s whole prompt
    sched.update(plan, worker.execute(plan), worker.logprobs)
    plan = sched.schedule()  # the beam's first candidates
    monkeypatch.setattr(BeamGroup, "step", overflow)
    outputs = sched.update(plan, worker.execute(plan), worker.logprobs)
    assert [o.request_id for o in outputs] == ["plain"]
    failures = sched.take_failures()
    assert [rid for rid, _ in failures] == ["beams"] and "OverflowError" in failures[0][1]
    assert "beams" not in sched.requests and not sched.beams.groups
    outputs, reasons, _ = run_to_completion(sched, worker)
    assert len(outputs["plain"]) == 4 and reasons["plain"] == "length"  # 2 tokens came before
    assert sched.kv.pool.num_used == 0


def test_a_length_penalty_that_would_overflow_is_refused():
    sched = make_scheduler()
    for value in (400.0, 1e308, -6.0):
        with pytest.raises(InvalidParameter) as e:
            add(sched, "b", [1, 2], max_tokens=4, beam_width=2, length_penalty=value)
        assert e.value.field == "length_penalty"
    add(sched, "ok", [1, 2], max_tokens=4, beam_width=2, length_penalty=-5.0)
    _, reasons, _ = run_to_completion(sched)
    assert reasons["ok"] == "stop"


def test_tiny_temperatures_are_greedy():
    from pagedllm import SamplingParams

    for t in (1e-38, 1e-50, 5e-6):
        assert SamplingParams(temperature=t).temperature == 0.0
    assert SamplingParams(temperature=1e-4).temperature == 1e-4
    assert np.isfinite(SamplingParams(temperature=1e-50).temperature)
