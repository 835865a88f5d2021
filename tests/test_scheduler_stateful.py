"""Random workloads against the scheduler; DESIGN.md's block invariants after every step, and
a fake worker that checks every request reads exactly its own tokens from the KV slots — with
and without a sliding window, prefix caching, async scheduling, worker restarts, forks, beams and
preemption of both kinds."""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core import EngineRequest, InvalidParameter, RequestStatus, SamplingParams
from pagedllm.core.utils import cdiv

from core_helpers import FakeWorker, make_scheduler, next_step

MAX_MODEL_LEN = 32
EOS = 1
# prompts start from a few common prefixes so that prefix-cache hits happen
PREFIXES = [list(range(2, 2 + MAX_MODEL_LEN)), list(range(40, 40 + MAX_MODEL_LEN)), [7] * MAX_MODEL_LEN]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        extra_blocks=st.integers(0, 10),
        budget=st.integers(4, 40),
        max_num_seqs=st.integers(1, 6),
        mode=st.sampled_from(["recompute", "swap"]),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        num_swap_blocks=st.integers(0, 24),
        placement=st.sampled_from(["lru", "first-fit", "best-fit"]),
        priority_preemption=st.booleans(),
        async_scheduling=st.booleans(),
        run_steps=st.sampled_from([1, 1, 2, 5]),
        window=st.sampled_from([None, None, 1, 3, 6, 13]),
    )
    def setup(
        self,
        block_size,
        extra_blocks,
        budget,
        max_num_seqs,
        mode,
        caching,
        policy,
        num_swap_blocks,
        placement,
        priority_preemption,
        async_scheduling,
        run_steps,
        window,
    ):
        # tight: the smallest pool the engine accepts (one max_model_len request fits, or with a
        # sliding window its window and one step), plus a little
        needed = cdiv(MAX_MODEL_LEN, block_size)
        if window:
            needed = min(needed, cdiv(window + budget, block_size) + 1)
        num_blocks = 1 + needed + extra_blocks
        self.sched = make_scheduler(
            block_size=block_size,
            num_blocks=num_blocks,
            budget=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            policy=policy,
            preemption_mode=mode,
            num_swap_blocks=num_swap_blocks,
            enable_prefix_caching=caching,
            block_placement=placement,
            priority_preemption=priority_preemption,
            sliding_window=window,
        )
        self.worker = FakeWorker(block_size, num_blocks, num_swap_blocks, vocab=12, window=window)
        self.next_id = 0
        self.expected_len: dict[str, int] = {}
        self.async_scheduling = async_scheduling
        self.run_steps = run_steps  # under async scheduling: decode runs of up to this many steps
        self.in_flight = []  # under async scheduling, the step planned ahead between rules
        self.texts: dict[str, list[int]] = {}  # each plain request's prompt and output so far
        self.histories: list[list[int]] = []  # those of requests that ended: a chat's turns so far

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        shared=st.integers(0, 31),
        tail=st.lists(st.integers(2, 60), max_size=30),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 3),
        ignore_eos=st.booleans(),
        n=st.sampled_from([1, 1, 2, 3]),
    )
    def add_request(self, prefix, shared, tail, max_tokens, priority, ignore_eos, n):
        self._add((PREFIXES[prefix][:shared] + tail)[: MAX_MODEL_LEN - 1] or [2], max_tokens, priority, ignore_eos, n)

    @precondition(lambda self: self.histories)
    @rule(data=st.data(), tail=st.lists(st.integers(2, 60), min_size=1, max_size=12), max_tokens=st.integers(1, 12))
    def add_follow_up(self, data, tail, max_tokens):
        """The next turn of a conversation: an ended request's prompt and output, and more (its
        blocks, freed into the prefix cache, are hits)."""
        history = data.draw(st.sampled_from(self.histories))
        self._add((history + tail)[: MAX_MODEL_LEN - 1], max_tokens, priority=0, ignore_eos=True, n=1)

    def _add(self, prompt, max_tokens, priority, ignore_eos, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.sched.add_request(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                eos_token_ids=[EOS],
                sampling_params=SamplingParams(
                    max_tokens=max_tokens,
                    ignore_eos=ignore_eos,
                    priority=priority,
                    n=min(n, self.sched.config.max_num_seqs),
                ),
            )
        )
        if n == 1:
            self.texts[rid] = list(prompt)

    @rule(
        prompt_len=st.integers(1, 20), width=st.integers(1, 3), max_tokens=st.integers(1, 8), ignore_eos=st.booleans()
    )
    def add_beam_search(self, prompt_len, width, max_tokens, ignore_eos):
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.sched.add_request(
                EngineRequest(
                    request_id=rid,
                    prompt_token_ids=PREFIXES[0][:prompt_len],
                    eos_token_ids=[EOS],
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, beam_width=width),
                )
            )
        except InvalidParameter as e:
            assert e.field == "beam_width"  # too many beams for this tiny cache

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(set(self.sched.requests) | set(self.sched.beams.groups))))
        self.sched.abort_requests([rid])
        assert rid not in self.sched.requests and rid not in self.sched.beams.groups

    # the engine forks only while applying results, never with a step planned ahead, and only
    # into sequence slots it holds for the fork
    @precondition(
        lambda self: (
            not self.in_flight
            and any(r.beam_group is None for r in self.sched.running)
            and self.sched._seats_taken(self.sched.running) < self.sched.config.max_num_seqs
        )
    )
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([r.request_id for r in self.sched.running if r.beam_group is None]))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.sched.fork_request(parent, child)

    @precondition(lambda self: self.sched.requests)
    @rule(kv_lost=st.booleans())
    def workers_die(self, kv_lost):
        """The workers die during a step and are replaced, as the engine core's `_recover` does:
        every step in flight — the one computing and, under async scheduling, the one planned
        after it — is undone (none had begun: the harder case for the KV they meant to write),
        a fresh worker state, the pool kept (shared memory) or lost (device memory)."""
        plan, _ = next_step(self.sched, self.in_flight, self.async_scheduling, self.run_steps)
        failed = [plan] if plan is not None else []
        if any(p is plan for p in self.in_flight):  # a decode run's step: it never ran either
            plan.num_steps += 1
        failed += [p for p in self.in_flight if p is not plan]
        self.in_flight = []
        self.sched.recover(failed, kv_lost)
        event("recovered with two steps in flight" if len(failed) == 2 else "recovered")
        if any(p.num_steps > 1 for p in failed):
            event("recovered inside a decode run")
        self.worker.restart(kv_lost)

    def _check_plan(self, plan):
        sched = self.sched
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
        assert plan.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert all(n > 0 for n in plan.num_scheduled_tokens.values())
        sched.check_invariants()
        for kind in ("block_copies", "swap_out", "swap_in", "preempted_request_ids", "appended_token_ids"):
            if getattr(plan, kind):
                event(kind)

    @rule()
    def step(self):
        """Apply one step's results. Under async scheduling the next step is planned first, as
        the engine core does, and stays in flight until the following `step`."""
        sched = self.sched
        plan, made = next_step(sched, self.in_flight, self.async_scheduling, self.run_steps)
        for new in made:
            self._check_plan(new)
        if self.in_flight:
            event("planned ahead")
        if any(p.num_steps > 1 for p in made):
            event("a decode run")
        if plan is None:
            event("empty plan")
            return
        if not plan.total_num_scheduled_tokens:
            event("a plan with no token that the workers must still see")
        sampled = self.worker.execute(plan)
        outputs = sched.update(plan, sampled, self.worker.logprobs)
        for out in outputs:
            if out.finish_reason == "length":
                assert out.request_id not in sched.requests
            text = self.texts.get(out.request_id)
            if text is not None:
                text += out.new_token_ids
                if out.finish_reason is not None and out.finish_reason != "abort":
                    self.histories.append(self.texts.pop(out.request_id))

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()
            assert len(self.sched.running) <= self.sched.config.max_num_seqs, "max_num_seqs exceeded"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(2000):
            if not sched.has_unfinished_requests() and not self.in_flight:
                break
            self.step()
        assert not sched.has_unfinished_requests() and not sched.beams.groups, (
            f"livelock: {list(sched.requests.values())} groups {list(sched.beams.groups)} free {sched.kv.pool.num_free}"
        )
        sched.check_invariants()
        plan, _ = next_step(sched, self.in_flight, self.async_scheduling)  # the last ended ids
        if plan is not None:
            self.worker.execute(plan)
        assert not self.worker.state.requests, f"the worker still holds {sorted(self.worker.state.requests)}"
        pool = sched.kv.pool
        assert pool.num_used == 0, "blocks still held after every request ended"
        assert all(pool.block(i).ref_cnt == 0 for i in range(pool.num_blocks))
        assert pool.num_free == pool.num_usable  # every block free or cached
        assert sched.kv.num_free_swap_blocks == sched.kv.num_swap_blocks
        assert not any(r.status == RequestStatus.RUNNING for r in sched.running)


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
