"""The differential test (conformance/differential.py): requests run together, with chunked
prefills, preemption, prefix hits, speculation, jump-forward and a worker killed, give what
each gives alone on an idle, plain engine; a difference is shrunk to the fewest requests that
still show it. `python -m pagedllm.conformance.differential` is the long version."""

from __future__ import annotations

import pytest

from pagedllm.conformance import differential
from pagedllm.conformance.differential import QUICK, SETTINGS, random_workload, run_setting


@pytest.mark.parametrize("name", QUICK)
def test_requests_run_together_give_what_each_gives_alone(name):
    printed = []
    workloads = 2 if name == "dense" else 1
    counts = run_setting(name, SETTINGS[name], workloads=workloads, requests=16, seed=0, out=printed.append)
    assert (counts["failures"], counts["hang"], counts["died"]) == (0, None, None), "\n".join(printed)
    # the features were on: a difference they made would have shown
    assert counts["preemptions"] > 0 and counts["prefix_hits"] > 0 and counts["proposals"] > 0
    if SETTINGS[name].kills:
        assert counts["kills"] > 0
    if SETTINGS[name].model is not None:  # a trained model: runs of proposed tokens were confirmed
        assert counts["accepted"] > 0


def test_a_difference_is_shrunk_to_the_requests_that_make_it(monkeypatch):
    requests = random_workload(3, 12)
    culprit, probe = requests[4], requests[7]

    def together(llm, batch):  # the last request differs while the culprit runs beside it
        return [("differs",) if r is batch[-1] and culprit in batch[:-1] else ("same",) for r in batch]

    monkeypatch.setattr(differential, "run_together", together)
    assert differential.shrink(None, requests, 7, ("same",)) == [culprit, probe]
