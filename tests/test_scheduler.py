import pytest

from pagedllm.core import InvalidParameter

from core_helpers import FakeWorker, add, fake_token, make_scheduler, run_to_completion


def test_long_prompt_is_chunked_while_decodes_keep_running():
    sched = make_scheduler(block_size=4, num_blocks=128, budget=16, max_model_len=256)
    worker = FakeWorker(4, 128)
    add(sched, "short", range(1, 6), max_tokens=30)
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))  # "short" is now decoding
    add(sched, "long", range(100, 160), max_tokens=2)  # 60 tokens > budget of 16
    chunks = []
    while True:
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= 16
        assert plan.num_scheduled_tokens["short"] == 1, "the decode stalled behind the prefill"
        chunks.append(plan.num_scheduled_tokens["long"])
        out = sched.update(plan, worker.execute(plan))
        sched.check_invariants()
        if any(o.request_id == "long" for o in out):
            break
    assert chunks == [15, 15, 15, 15]
    assert sum(chunks) == 60


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_five_requests_finish_with_blocks_for_two(mode):
    # each request needs 20 + 12 = 32 tokens = 8 blocks of 4; the pool holds 16 usable blocks
    def run(num_blocks, mode):
        sched = make_scheduler(
            block_size=4,
            num_blocks=num_blocks,
            budget=64,
            max_model_len=32,
            preemption_mode=mode,
            num_swap_blocks=64 if mode == "swap" else 0,
            enable_prefix_caching=False,
        )
        for i in range(5):
            add(sched, f"r{i}", range(10 * i + 1, 10 * i + 21), max_tokens=12)
        outputs, reasons, plans = run_to_completion(sched)
        return sched, outputs, reasons, plans

    sched, outputs, reasons, plans = run(17, mode)
    assert sched.num_preemptions > 0
    assert sorted(outputs) == [f"r{i}" for i in range(5)]
    assert all(len(toks) == 12 for toks in outputs.values())
    assert set(reasons.values()) == {"length"}
    if mode == "swap":
        assert any(p.swap_out for p in plans) and any(p.swap_in for p in plans)
    assert sched.kv.pool.num_used == 0
    # greedy-like outputs do not change because of preemption
    _, unconstrained, _, _ = run(200, mode)
    assert outputs == unconstrained


@pytest.mark.parametrize("policy,expected_victim", [("priority", "low"), ("fcfs", "late")])
def test_victim_is_lowest_priority_then_latest_arrival(policy, expected_victim):
    # 3 requests of 8 prompt tokens = 6 blocks; 8 usable blocks run out as they decode
    sched = make_scheduler(
        block_size=4, num_blocks=9, budget=64, max_model_len=32, policy=policy, enable_prefix_caching=False
    )
    add(sched, "low", range(1, 9), max_tokens=20, priority=5)  # arrives first, lowest priority
    add(sched, "high", range(11, 19), max_tokens=20, priority=0)
    add(sched, "late", range(21, 29), max_tokens=20, priority=1)  # arrives last
    worker = FakeWorker(4, 9)
    plan = sched.schedule()
    assert set(plan.num_scheduled_tokens) == {"low", "high", "late"}
    sched.update(plan, worker.execute(plan))
    while True:
        plan = sched.schedule()
        sched.check_invariants()
        if plan.preempted_request_ids:
            break
        sched.update(plan, worker.execute(plan))
    assert plan.preempted_request_ids == [expected_victim]


@pytest.mark.parametrize("first_still_running", [True, False])
def test_shared_three_block_prefix_allocates_only_new_blocks(first_still_running):
    sched = make_scheduler(block_size=4, num_blocks=64, budget=64, max_model_len=64)
    prefix = list(range(1, 13))  # 3 full blocks
    worker = FakeWorker(4, 64)
    add(sched, "a", prefix + [50, 51], max_tokens=10 if first_still_running else 1)
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    a_blocks = sched.kv.block_ids("a") if first_still_running else plan.new_requests[0].block_ids
    used_before = sched.kv.pool.num_used
    hits_before, queries_before = sched.kv.pool.prefix_hits, sched.kv.pool.prefix_queries
    add(sched, "b", prefix + [60, 61, 62, 63, 64], max_tokens=1)  # 17 tokens = 5 blocks
    plan = sched.schedule()
    assert plan.num_scheduled_tokens["b"] == 5
    b_blocks = sched.kv.block_ids("b")
    assert len(b_blocks) == 5
    assert b_blocks[:3] == a_blocks[:3]
    assert not set(b_blocks[3:]) & set(a_blocks if first_still_running else a_blocks[:3])
    # b took only 2 fresh blocks; a finished earlier leaves its prefix cached, and b revives it
    assert sched.kv.pool.num_used - used_before == (2 if first_still_running else 5)
    assert sched.kv.pool.prefix_hits - hits_before == 12
    assert sched.kv.pool.prefix_queries - queries_before == 17
    shared = b_blocks[:3]
    expected_refs = 2 if first_still_running else 1
    assert [sched.kv.pool.block(i).ref_cnt for i in shared] == [expected_refs] * 3
    sched.update(plan, worker.execute(plan))  # the fake worker checks b reads a's KV
    sched.check_invariants()


def test_fork_then_one_append_each_copies_the_shared_block_once():
    sched = make_scheduler(block_size=4, num_blocks=32, budget=64)
    worker = FakeWorker(4, 32)
    add(sched, "p", range(1, 11), max_tokens=8)  # 10 tokens: the third block holds 2
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    child = sched.fork_request("p", "c")
    assert sched.kv.block_ids("c") == sched.kv.block_ids("p")
    assert all(sched.kv.pool.block(i).ref_cnt == 2 for i in sched.kv.block_ids("p"))
    used = sched.kv.pool.num_used
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"p": 1, "c": 1}
    assert len(plan.block_copies) == 1
    src, dst = plan.block_copies[0]
    assert src == sched.kv.block_ids("c")[2] and dst == sched.kv.block_ids("p")[2]
    assert sched.kv.pool.num_used == used + 1
    assert sched.kv.block_ids("p")[:2] == sched.kv.block_ids("c")[:2]
    sched.update(plan, worker.execute(plan))
    sched.check_invariants()
    assert child.output_token_ids != sched.requests["p"].output_token_ids
    plan = sched.schedule()
    assert plan.block_copies == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_conditions(async_scheduling):
    sched = make_scheduler(max_model_len=40)
    add(sched, "eos", [1, 2, 3], max_tokens=30, eos_token_id=fake_token("eos", 5))
    add(sched, "min", [1, 2, 3], max_tokens=30, eos_token_id=fake_token("min", 3), min_tokens=3)
    add(sched, "stopid", [1, 2, 3], max_tokens=30, stop_token_ids=[fake_token("stopid", 4)])
    add(sched, "ignore", [1, 2, 3], max_tokens=5, eos_token_id=fake_token("ignore", 3), ignore_eos=True)
    add(sched, "modellen", list(range(1, 36)), max_tokens=None)
    outputs, reasons, _ = run_to_completion(sched, async_scheduling=async_scheduling)
    assert outputs["eos"] == [fake_token("eos", p) for p in (3, 4, 5)] and reasons["eos"] == "stop"
    assert len(outputs["min"]) >= 3 and reasons["min"] in ("stop", "length")
    assert outputs["stopid"][-1] == fake_token("stopid", 4) and reasons["stopid"] == "stop"
    assert len(outputs["ignore"]) == 5 and reasons["ignore"] == "length"
    assert len(outputs["modellen"]) == 5 and reasons["modellen"] == "length"


def test_async_scheduling_plans_decodes_ahead_with_the_same_tokens_and_prefix_hits():
    """Planned before the step in flight has sampled, a decode's next step computes the token
    the worker is about to sample; the outputs equal planning after the results, a stop costs
    one token computed in vain, and a block completed by a planned-ahead token still enters the
    prefix cache once that token is known."""
    runs = {}
    for async_scheduling in (False, True):
        sched = make_scheduler(block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64)
        for i in range(6):  # more than max_num_seqs; the even ones stop on EOS, the odd at their length
            eos = fake_token(f"r{i}", 7 + i) if i % 2 == 0 else None
            add(sched, f"r{i}", range(10 * i + 1, 10 * i + 4), max_tokens=9 + i, eos_token_id=eos)
        worker = FakeWorker(4, 64)
        outputs, reasons, plans = run_to_completion(sched, worker, async_scheduling=async_scheduling)
        # a sequence that ended at its length, again: its blocks should be in the cache, the
        # last one completed by a planned-ahead token too
        first = list(range(11, 14)) + outputs["r1"]
        add(sched, "again", first + [99], max_tokens=1)
        hits_before = sched.kv.pool.prefix_hits
        run_to_completion(sched, worker, async_scheduling=async_scheduling)
        runs[async_scheduling] = (outputs, reasons, plans, sched.kv.pool.prefix_hits - hits_before)
    sync, ahead = runs[False], runs[True]
    assert ahead[0] == sync[0] and ahead[1] == sync[1]
    assert "stop" in sync[1].values() and "length" in sync[1].values()
    assert ahead[3] == sync[3] == (len(first) // 4) * 4, "a planned-ahead block was never cached"
    # fewer plans than steps of tokens would be wrong; more (wasted) only by the stops
    wasted = sum(n for p in ahead[2] for n in p.num_scheduled_tokens.values()) - sum(
        n for p in sync[2] for n in p.num_scheduled_tokens.values()
    )
    assert wasted == list(sync[1].values()).count("stop")


def test_decode_runs_give_the_tokens_of_single_steps_and_are_undone_where_they_stopped():
    """A decode run (steps the workers take on their own) gives what steps planned one at a time
    give, stops and length limits included, and caches the same blocks; no run passes a
    request's length limit. Workers that die inside a run undo only its steps not applied."""
    runs, lengths = {}, []
    for run_steps in (1, 5):
        sched = make_scheduler(block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64)
        planned = sched.schedule_ahead

        def record(in_flight, most=1, planned=planned):
            plan = planned(in_flight, most)
            if plan is not None:
                lengths.append(plan.num_steps)
            return plan

        sched.schedule_ahead = record
        for i in range(6):
            eos = fake_token(f"r{i}", 7 + i) if i % 2 == 0 else None
            add(sched, f"r{i}", range(10 * i + 1, 10 * i + 4), max_tokens=9 + i, eos_token_id=eos)
        worker = FakeWorker(4, 64)
        outputs, reasons, _ = run_to_completion(sched, worker, async_scheduling=True, run_steps=run_steps)
        add(sched, "again", list(range(11, 14)) + outputs["r1"] + [99], max_tokens=1)
        hits_before = sched.kv.pool.prefix_hits
        run_to_completion(sched, worker, async_scheduling=True, run_steps=run_steps)
        runs[run_steps] = (outputs, reasons, sched.kv.pool.prefix_hits - hits_before)
    assert runs[5] == runs[1] and "stop" in runs[1][1].values()
    assert max(lengths) == 5 and 1 < min(n for n in lengths if n > 1) < 5, "runs cut short by a length limit"

    # the workers die after two of a run's five steps came back
    sched = make_scheduler(block_size=4, num_blocks=32, max_model_len=64)
    worker = FakeWorker(4, 32)
    add(sched, "a", [5, 6, 7], max_tokens=20)
    first = sched.schedule()
    run = sched.schedule_ahead(first, 5)
    assert run is not None and run.num_steps == 5 and run.num_scheduled_tokens == {"a": 1}
    sched.update(first, worker.execute(first))
    for _ in range(2):
        sched.update(run, worker.execute(run))
        run.num_steps -= 1  # as the engine core counts a run's steps applied
    sched.recover([run], kv_lost=False)
    assert sched.requests["a"].num_computed_tokens == 3 + 2  # the prompt and the two steps applied
    worker.restart()
    outputs, _, _ = run_to_completion(sched, worker)  # the fake worker checks every position it reads
    assert len(outputs["a"]) == 20 - 3


def test_recovery_drops_a_block_keyed_for_a_planned_step_that_never_ran():
    """A request stops on its first token while the step after it is already planned: the
    block that step completes is keyed in the prefix cache. The workers die before running it;
    the block must not be found by the next request with that prefix (its KV was never written)."""
    sched = make_scheduler(block_size=4, num_blocks=32)
    worker = FakeWorker(4, 32)
    eos = fake_token("a", 3)
    add(sched, "a", [5, 6, 7], max_tokens=8, eos_token_id=eos)
    plan = sched.schedule()
    ahead = sched.schedule_ahead(plan)
    assert ahead is not None and ahead.num_scheduled_tokens == {"a": 1}
    (out,) = sched.update(plan, worker.execute(plan))
    assert out.finish_reason == "stop"
    sched.recover([ahead], kv_lost=False)  # `ahead` never ran: position 3 holds nothing
    worker.restart()
    add(sched, "b", [5, 6, 7, eos, 9], max_tokens=1)
    run_to_completion(sched, worker)  # the fake worker checks every position it reads
    assert sched.kv.pool.prefix_hits == 0


@pytest.mark.parametrize("kind", ["beams", "samples"])
def test_recovery_recomputes_a_request_that_started_on_blocks_keyed_in_the_failed_step(kind):
    """A beam, or an n > 1 request, computes all but its last prompt token before its group
    decodes or it forks; here the prefix cache holds all of those, in blocks that another
    request started in the same step keyed (and did not write: the workers die first). It
    started without being sent to the worker, so nothing in the step says it leans on them."""
    sched = make_scheduler(block_size=2, num_blocks=40)
    worker = FakeWorker(2, 40)
    add(sched, "long", range(2, 16), max_tokens=2)
    params = {"beam_width": 2} if kind == "beams" else {"n": 2}
    add(sched, "short", [2, 3, 4], max_tokens=2, **params)
    plan = sched.schedule()
    assert set(plan.num_scheduled_tokens) == {"long"}  # "short" started on its hits alone
    sched.recover([plan], kv_lost=False)
    worker.restart()
    run_to_completion(sched, worker)  # the fake worker checks every position it reads


def test_a_fork_after_recovery_shares_no_block_past_the_computed_tokens():
    """Two steps planned ahead die with the workers: the request's table held blocks for both.
    Were they kept, a fork would share a block past the computed tokens, one the two requests
    then both write (a table's fresh block needs no copy-on-write)."""
    sched = make_scheduler(block_size=1, num_blocks=80, enable_prefix_caching=False)
    worker = FakeWorker(1, 80)
    add(sched, "a", range(2, 10), max_tokens=6)
    plan = sched.schedule()
    ahead = sched.schedule_ahead(plan)
    sched.update(plan, worker.execute(plan))
    after = sched.schedule_ahead(ahead)
    assert after is not None
    sched.recover([ahead, after], kv_lost=False)
    worker.restart()
    assert sched.kv.num_blocks_of(sched.requests["a"]) == 8  # its computed tokens, no more
    sched.fork_request("a", "b")
    outputs, _, _ = run_to_completion(sched, worker)  # the fake worker checks every position it reads
    assert len(outputs["b"]) == 5


def test_recovery_recomputes_a_request_whose_block_was_copied_on_write_in_the_failed_step():
    """A fork's first step copies the parent's shared partial block; the workers die before
    the copy. The copy is not redone later: its source's other holder (the child, new in that
    step) is requeued, which frees the source for any allocation — a swap-in writes into its
    block before the step's copies run. The parent is recomputed instead."""
    sched = make_scheduler(block_size=4, num_blocks=32, enable_prefix_caching=False)
    worker = FakeWorker(4, 32)
    add(sched, "a", range(2, 8), max_tokens=6)
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    sched.fork_request("a", "b")
    plan = sched.schedule()
    ((src, dst),) = plan.block_copies
    assert dst in sched.kv.block_ids("a")
    sched.recover([plan], kv_lost=False)
    worker.restart()
    assert sched.kv.pool.block(src).ref_cnt == 0  # free: what it holds may be gone by the next step
    assert {r.request_id for r in sched.waiting} == {"a", "b"}
    outputs, _, _ = run_to_completion(sched, worker)  # the fake worker checks every position it reads
    assert len(outputs["a"]) == 5 and len(outputs["b"]) == 5


def test_abort_frees_blocks_immediately_and_in_every_state():
    sched = make_scheduler(
        block_size=4, num_blocks=12, budget=64, max_model_len=32, preemption_mode="swap", num_swap_blocks=32
    )
    worker = FakeWorker(4, 12, 32)
    for i in range(4):
        add(sched, f"r{i}", range(10 * i + 1, 10 * i + 13), max_tokens=16)
    states = set()
    for _ in range(8):
        plan = sched.schedule()
        sched.update(plan, worker.execute(plan))
        states |= {r.status.name for r in sched.requests.values()}
    assert {"RUNNING", "SWAPPED"} <= states or {"RUNNING", "WAITING"} <= states
    out = sched.abort_requests(list(sched.requests) + ["unknown"])
    assert {o.finish_reason for o in out} == {"abort"}
    sched.check_invariants()
    assert sched.kv.pool.num_used == 0 and sched.kv.num_free_swap_blocks == 32
    assert not sched.has_unfinished_requests()
    plan = sched.schedule()
    # no token to compute, but the workers must drop what they hold: the plan is not empty
    assert plan.total_num_scheduled_tokens == 0 and not plan.is_empty
    assert sorted(plan.finished_request_ids + plan.preempted_request_ids)


def test_bad_requests_are_rejected_with_the_field_named():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidParameter, match="prompt"):
        add(sched, "empty", [])
    with pytest.raises(InvalidParameter, match="max_model_len is 16"):
        add(sched, "long", range(1, 18))
    add(sched, "ok", [1, 2])
    with pytest.raises(InvalidParameter, match="request_id"):
        add(sched, "ok", [1, 2])


@pytest.mark.parametrize("prompt_len", [1, 10, 16, 17])
def test_n_samples_share_the_prompt_blocks(prompt_len):
    sched = make_scheduler(block_size=4, num_blocks=64, budget=64, max_model_len=64, enable_prefix_caching=False)
    add(sched, "r", range(1, prompt_len + 1), max_tokens=6, n=4, seed=7)
    worker = FakeWorker(4, 64)
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    if prompt_len > 1:
        assert plan.num_scheduled_tokens == {"r": prompt_len - 1}
    ids = ["r", "r#1", "r#2", "r#3"]
    assert sorted(sched.requests) == ids
    full_prompt_blocks = (prompt_len - 1) // 4
    tables = [sched.kv.block_ids(i) for i in ids]
    assert all(t[:full_prompt_blocks] == tables[0][:full_prompt_blocks] for t in tables)
    seeds = {sched.requests[i].sampling_params.seed for i in ids}
    assert len(seeds) == 4  # each sample its own seed stream
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {i: 1 for i in ids}
    partial = (prompt_len - 1) % 4 != 0
    assert len(plan.block_copies) == (3 if partial else 0)  # the shared partial block, copied on write
    sched.update(plan, worker.execute(plan))
    _outputs, reasons, _ = run_to_completion(sched, worker)
    sched.check_invariants()
    assert sorted(reasons) == ids


def test_beam_search_wider_than_max_num_seqs_is_refused_and_one_as_wide_finishes():
    """The beams of a search run together: a search wider than max_num_seqs could never be
    scheduled again after a preemption (it livelocked in the stateful test)."""
    sched = make_scheduler(block_size=1, num_blocks=33, budget=4, max_num_seqs=2, max_model_len=32)
    with pytest.raises(InvalidParameter, match=r"beam_width.*max_num_seqs"):
        add(sched, "wide", [2], max_tokens=2, beam_width=3)
    add(sched, "long", range(2, 29), max_tokens=3)
    add(sched, "beams", [2], max_tokens=2, beam_width=2)
    _outputs, reasons, _ = run_to_completion(sched)
    assert reasons == {"long": "length", "beams": "stop"}


def test_a_preempted_beam_group_comes_back_when_the_budget_takes_one_beam_a_step():
    """After a recompute preemption each beam recomputes its whole sequence, and here the
    budget holds one beam's: the first beam back must wait for its sibling to start in the
    next step, not go back to wait whole (which let the two take turns for ever). The first
    beam starts again in the step that preempted it, with its group's last choice already in
    its tokens: the worker must not be told to append that token as well."""
    sched = make_scheduler(
        block_size=4, num_blocks=200, budget=9, max_num_seqs=2, policy="priority", enable_prefix_caching=False
    )
    worker = FakeWorker(4, 200)
    outputs = {}
    add(sched, "beams", range(1, 9), max_tokens=6, beam_width=2, priority=3)
    while len(sched.beams.groups["beams"].members) < 2 or sched.requests["beams"].num_tokens < 10:
        _step(sched, worker, outputs)
    add(sched, "urgent", [100], max_tokens=2, priority=0)
    _step(sched, worker, outputs)
    assert sched.num_preemptions == 2  # the group, whole
    assert any(rid.startswith("beams") for rid in worker.state.requests)
    for rid, state in worker.state.requests.items():
        assert state.token_ids == sched.requests[rid].all_token_ids, rid
    _outputs, reasons, _ = run_to_completion(sched, worker, max_steps=100)
    assert reasons == {"urgent": "length", "beams": "stop"}


def test_two_beam_groups_recomputed_together_do_not_take_turns_for_ever():
    """Both groups start again in one step, the second with part of its beams' prompts: the
    first group's decode then needs blocks the second's prefill chunks would take. Decodes
    come first, so the later group yields (it took turns with the first for ever when prefill
    chunks went first and made the first group preempt itself)."""
    sched = make_scheduler(
        block_size=8, num_blocks=7, max_num_seqs=6, max_model_len=32, budget=32, enable_prefix_caching=False
    )
    worker = FakeWorker(8, 7)
    add(sched, "a", range(2, 10), max_tokens=8, beam_width=3)
    add(sched, "b", range(2, 9), max_tokens=5, beam_width=3)
    for _ in range(2):
        _step(sched, worker, {})
    assert [len(g.members) for g in sched.beams.groups.values()] == [3, 3]
    sched.recover([], kv_lost=True)  # every beam recomputes
    worker.restart(kv_lost=True)
    _outputs, reasons, _ = run_to_completion(sched, worker, max_steps=200)
    assert reasons == {"a": "stop", "b": "stop"}


def test_a_half_admitted_beam_group_yields_to_a_swapped_request():
    """Its waiting beam is first in the waiting queue, but a swapped request goes before the
    waiting ones and needs the blocks the running beam holds: the beam goes back to wait."""
    sched = make_scheduler(
        block_size=4,
        num_blocks=11,
        max_num_seqs=3,
        max_model_len=32,
        budget=21,
        preemption_mode="swap",
        num_swap_blocks=10,
        enable_prefix_caching=False,
    )
    worker = FakeWorker(4, 11, 10)
    add(sched, "a", range(2, 27), max_tokens=10)
    add(sched, "b", range(2, 12), max_tokens=3)
    add(sched, "beams", range(2, 11), max_tokens=6, beam_width=2)
    add(sched, "c", range(30, 50), max_tokens=11)
    _outputs, reasons, _ = run_to_completion(sched, worker, max_steps=300)
    assert set(reasons) == {"a", "b", "beams", "c"}


def test_colliding_prefix_keys_never_hand_one_request_anothers_kv(monkeypatch):
    """Every full block gets the same cache key, so each lookup finds a candidate: only equal
    tokens after an equal parent may be a hit. The fake worker checks that every request
    reads exactly its own tokens from the KV slots."""
    monkeypatch.setattr("pagedllm.core.scheduling.kv_cache_manager.hash_block_tokens", lambda parent, tokens: 7)
    sched = make_scheduler(block_size=4, num_blocks=64)
    worker = FakeWorker(4, 64)
    add(sched, "a", range(10, 30), max_tokens=4)
    run_to_completion(sched, worker)  # a's first block is now cached under key 7
    add(sched, "b", range(40, 60), max_tokens=4)  # another prompt: the same keys
    outputs, _, _ = run_to_completion(sched, worker)
    assert sched.kv.pool.prefix_hits == 0
    assert outputs["b"] == [fake_token("b", 20 + i) for i in range(4)]
    add(sched, "a-again", range(10, 30), max_tokens=4)  # a's prompt does hit its first block
    run_to_completion(sched, worker)
    assert sched.kv.pool.prefix_hits == 4


def _step(sched, worker, outputs):
    plan = sched.schedule()
    sched.check_invariants()
    for out in sched.update(plan, worker.execute(plan), worker.logprobs):
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return plan


@pytest.mark.parametrize("limit", ["max_num_seqs", "blocks"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_high_priority_arrival_preempts_lower_priority_work(limit, mode):
    """8 long low-priority generations fill the engine (every sequence slot, or every block);
    a high-priority request arriving is scheduled within 2 steps, the victims finish later
    with the tokens they would have had."""
    # every slot taken from the start; or 48 usable blocks, all taken from step 13 on
    full = dict(max_num_seqs=8, num_blocks=200) if limit == "max_num_seqs" else dict(max_num_seqs=16, num_blocks=49)
    arrives = 12 if limit == "max_num_seqs" else 14
    kw = dict(block_size=4, budget=64, max_model_len=64, enable_prefix_caching=False, preemption_mode=mode)

    def run(policy, urgent_at):
        sched = make_scheduler(**kw, **full, policy=policy, num_swap_blocks=64 if mode == "swap" else 0)
        worker = FakeWorker(4, sched.cache_config.num_blocks, sched.cache_config.num_swap_blocks)
        for i in range(8):  # 8 x (8 prompt + 40 output tokens) = 96 blocks of 4 at the end
            add(sched, f"low{i}", range(10 * i + 1, 10 * i + 9), max_tokens=40, priority=5)
        outputs, steps = {}, 0
        first_token_step = None
        while sched.has_unfinished_requests():
            if steps == urgent_at:
                add(sched, "urgent", range(200, 208), max_tokens=4, priority=0)
            plan = _step(sched, worker, outputs)
            if first_token_step is None and "urgent" in plan.num_scheduled_tokens:
                first_token_step = steps
            steps += 1
        return outputs, first_token_step, sched

    baseline, _, _ = run("fcfs", urgent_at=None)
    # with fcfs the urgent request waits for a low-priority one to finish
    _, fcfs_start, _ = run("fcfs", urgent_at=arrives)
    assert fcfs_start > arrives + 10
    outputs, start, sched = run("priority", urgent_at=arrives)
    assert start - arrives < 2, f"scheduled {start - arrives} steps after it arrived"
    assert sched.num_preemptions > 0 and sched.num_priority_preemptions > 0
    assert {k: v for k, v in outputs.items() if k != "urgent"} == baseline
    assert len(outputs["urgent"]) == 4


def test_equal_priority_is_never_preempted_for_a_waiting_request():
    sched = make_scheduler(block_size=4, num_blocks=200, budget=64, max_num_seqs=4, policy="priority")
    worker = FakeWorker(4, 200)
    outputs = {}
    for i in range(4):
        add(sched, f"r{i}", range(10 * i + 1, 10 * i + 9), max_tokens=30, priority=1)
    for _ in range(3):
        _step(sched, worker, outputs)
    add(sched, "same", range(100, 108), max_tokens=4, priority=1)
    add(sched, "later", range(110, 118), max_tokens=4, priority=2)
    for _ in range(10):
        plan = _step(sched, worker, outputs)
        assert not plan.preempted_request_ids
        assert "same" not in plan.num_scheduled_tokens and "later" not in plan.num_scheduled_tokens
    assert sched.num_preemptions == 0


def test_a_beam_group_is_preempted_whole_for_a_higher_priority_request():
    sched = make_scheduler(block_size=4, num_blocks=200, budget=64, max_num_seqs=4, policy="priority")
    worker = FakeWorker(4, 200)
    outputs = {}
    add(sched, "beams", range(1, 9), max_tokens=20, beam_width=2, temperature=0, priority=3)
    add(sched, "other", range(11, 19), max_tokens=30, priority=2)
    add(sched, "other2", range(21, 29), max_tokens=30, priority=2)
    for _ in range(4):
        _step(sched, worker, outputs)
    assert len(sched.running) == 4  # two beams and two others: every slot
    add(sched, "urgent", range(100, 108), max_tokens=4, priority=0)
    plan = _step(sched, worker, outputs)
    beams = {r for r in plan.preempted_request_ids if r.startswith("beams")}
    assert len(beams) == 2 and not {"other", "other2"} & set(plan.preempted_request_ids)
    assert "urgent" in plan.num_scheduled_tokens


def test_a_step_holds_at_most_max_loras_adapters_and_those_waiting_for_a_slot_are_passed_over():
    """Two adapter slots: requests of a third adapter wait while two others run, and the base
    model's and the running adapters' requests behind them go first (as vLLM's scheduler);
    every request finishes, in every step at most two adapters."""
    from pagedllm.core import EngineRequest, SamplingParams
    from pagedllm.core.lora import LoRARequest

    sched = make_scheduler(max_loras=2, max_model_len=64)
    adapters = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc")}
    order = ["a", "b", "c", None, "a", "c", None]
    for i, name in enumerate(order):
        sched.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=list(range(1 + i, 9 + i)),
                sampling_params=SamplingParams(max_tokens=4 + 4 * (name == "a"), ignore_eos=True),
                lora=adapters[name] if name else None,
            )
        )
    worker = FakeWorker(4, 64)
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1", "r3", "r4", "r6"}  # c's wait
    outputs = {out.request_id: out.new_token_ids for out in sched.update(first, worker.execute(first))}
    rest, _, plans = run_to_completion(sched, worker)
    assert sorted({**outputs, **rest}) == [f"r{i}" for i in range(len(order))]
    for plan in [first, *plans]:
        held = {order[int(rid[1:])] for rid in plan.num_scheduled_tokens} - {None}
        assert len(held) <= 2, plan.num_scheduled_tokens
