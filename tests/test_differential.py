"""The differential test (conformance/differential.py): requests run together, with chunked
prefills, preemption, prefix hits and speculation, give what each gives alone on an idle
engine; a difference is shrunk to the fewest requests that still show it."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.conformance import differential
from pagedllm.conformance.differential import ALONE, SHAPE, TOGETHER, differing, random_workload


def test_requests_run_together_give_what_each_gives_alone(tiny_model):
    model = tiny_model("llama")
    common = {"dtype": "float32", **SHAPE}
    with LLM(model, **common, **TOGETHER) as together, LLM(model, **common, **ALONE) as alone:
        for seed in (0, 1):
            requests = random_workload(seed, 16)
            together_out = differential.run_together(together, requests)
            assert differing(together_out, differential.run_alone(alone, requests)) == []
        stats = together.last_stats.scheduler
    # the features were on: a difference they made would have shown
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_decode.num_drafts > 0


def test_a_difference_is_shrunk_to_the_requests_that_make_it(monkeypatch):
    requests = random_workload(3, 12)
    culprit, probe = requests[4], requests[7]

    def together(llm, batch):  # the last request differs while the culprit runs beside it
        return [("differs",) if r is batch[-1] and culprit in batch[:-1] else ("same",) for r in batch]

    monkeypatch.setattr(differential, "run_together", together)
    assert differential.shrink(None, requests, 7, ("same",)) == [culprit, probe]
