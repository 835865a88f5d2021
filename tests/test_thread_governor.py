"""The worker's thread governor: it must find the faster thread count for each size of step,
follow the machine's load when it changes, and spend few steps measuring; and a step's result
must not depend on the thread count it picked."""

import itertools

import pytest
import torch

from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.backends.thread_governor import LAST_INTERVAL, ThreadGovernor, thread_choices
from pagedllm.core.errors import InvalidParameter
from pagedllm.entrypoints.default_model import shipped_model_dir


class Machine:
    """A fake clock whose steps cost `cost[threads]` seconds per token."""

    def __init__(self, cost: dict[int, float]):
        self.cost = cost
        self.now = 0.0
        self.threads = max(cost)
        self.history: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def run(self, governor: ThreadGovernor, steps: int, tokens: int = 1) -> list[int]:
        picked = []
        for _ in range(steps):
            governor.begin(tokens)
            assert self.threads == governor.current
            self.now += self.cost[self.threads] * tokens
            governor.end()
            picked.append(self.threads)
        return picked


def test_thread_choices():
    assert thread_choices(1) == [1]
    assert thread_choices(2) == [1, 2]
    assert thread_choices(6) == [1, 2, 4, 6]
    assert thread_choices(8) == [1, 2, 4, 8]


def test_it_runs_the_faster_count_and_measures_the_other_rarely():
    m = Machine({1: 1.0, 2: 0.6})  # an idle machine, a large step: both cores pay
    gov = ThreadGovernor(2, m.set_threads, m.clock)
    picked = m.run(gov, 2000, tokens=256)
    assert picked[-1] == 2
    # after the first measurements, a few steps of one thread now and then: under 2% of them
    assert picked[10:].count(1) <= 0.02 * len(picked)


def test_it_follows_the_load_when_another_process_takes_a_core():
    m = Machine({1: 1.0, 2: 0.6})
    gov = ThreadGovernor(2, m.set_threads, m.clock)
    m.run(gov, 500)
    assert gov.current == 2
    m.cost = {1: 1.3, 2: 6.0}  # a busy neighbour: every parallel region waits for a descheduled thread
    picked = m.run(gov, 500)
    assert picked.index(1) <= 3, "the slowdown is noticed at once"
    # each re-measurement of two threads costs one step, not three: it is clearly slower
    checks = sum(1 for a, b in itertools.pairwise(picked[10:]) if a == 1 and b == 2)
    assert picked[10:].count(2) == checks <= 5
    m.cost = {1: 1.0, 2: 0.6}  # the neighbour is gone
    picked = m.run(gov, 2 * LAST_INTERVAL + 20)
    assert picked[-1] == 2
    assert picked.index(2) < LAST_INTERVAL + 10


def test_each_size_of_step_has_its_own_choice():
    costs = {1: {1: 0.2, 2: 0.5}, 512: {1: 1.0, 2: 0.55}}  # a decode is cheaper alone, a prefill is not
    m = Machine(costs[1])
    gov = ThreadGovernor(2, m.set_threads, m.clock)
    for _ in range(50):
        for tokens, cost in costs.items():
            m.cost = cost
            m.run(gov, 5, tokens)
    assert m.run(gov, 1, 512) == [2]
    m.cost = costs[1]
    assert m.run(gov, 1, 1) == [1]


@pytest.fixture(scope="module")
def runner():
    model = load_model(shipped_model_dir(), dtype="float32")
    return ModelRunner(model, CpuAttentionOps(), allocate_kv_caches(model, 64, 16), 16)


def test_a_steps_logits_do_not_depend_on_the_thread_count(runner):
    """The governor may change the count between any two steps: greedy tokens must not move."""
    before = torch.get_num_threads()
    prompts = [list(range(10, 10 + n)) for n in (1, 7, 40, 130)]
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            mixed = runner.execute([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
            decodes = runner.execute([SeqInput([5], len(p), t) for p, t in zip(prompts, tables)])
            results.append((mixed, decodes))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_cpu_threads_is_checked():
    from pagedllm.core.config import EngineConfig

    with pytest.raises(InvalidParameter, match="cpu_threads"):
        EngineConfig(model="m", cpu_threads=0)
