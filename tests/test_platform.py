"""The backend owns its device: the worker asks the backend's platform face for every device
decision, as a port to an accelerator that is neither CUDA nor a CPU needs; the contract has a
version, and a change to its surface without a new one fails here."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.contract import surface
from pagedllm.backends.platform import CONTRACT_VERSION
from pagedllm.backends.registry import BackendUnavailable, check_available, load_backend

from proc_helpers import children_of, segments_of, workers_of

# the default path, its workers replaced and its processes counted: a launcher that is the core's own child
pytestmark = pytest.mark.usefixtures("own_launcher")

CHECKOUT = Path(__file__).resolve().parent.parent
CUDA_FOLDERS = ("backends/cuda_native/", "backends/triton/", "backends/gpu/")
# a decision on a device string: comparing it, testing its prefix, or calling into torch.cuda
DEVICE_TEST = re.compile(
    r"""startswith\(\s*["'](cuda|cpu)|device[\w.]*\s*[=!]=\s*["']|[=!]=\s*["']cuda|["']cuda["']\s*[=!]=|torch\.cuda\."""
)


def test_no_device_string_decision_outside_the_cuda_backends():
    hits = []
    for folder in ("core", "backends", "entrypoints", "conformance"):
        for path in sorted((CHECKOUT / folder).rglob("*.py")):
            rel = path.relative_to(CHECKOUT).as_posix()
            if rel.startswith(CUDA_FOLDERS):
                continue
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if DEVICE_TEST.search(line.split("#")[0]):
                    hits.append(f"{rel}:{number}: {line.strip()}")
    assert not hits, "ask the backend's platform face instead:\n" + "\n".join(hits)


def test_a_port_that_is_neither_cuda_nor_cpu_is_asked_for_every_device_decision(
    plugins_installed, tiny_model, tmp_path, monkeypatch
):
    """The example plugin keeps its pool in its own memory, sized by its own memory query,
    names its distributed backend and default dtype, and has a graph hook. Started with two
    ranks, run, one rank killed: each decision is the plugin's, on both ranks and again in
    the replacements, and the restart recomputes (nothing survives in a pool of its own)."""
    log = tmp_path / "platform.log"
    monkeypatch.setenv("PAGEDLLM_TEST_PLATFORM_LOG", str(log))
    monkeypatch.setenv("PAGEDLLM_TEST_DEVICE_MEMORY", str(4 << 20))
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(
        tiny_model("llama"),
        backend="example",
        tensor_parallel_size=2,
        max_model_len=256,
        preemption_mode="swap",
        swap_space="1MiB",
        max_worker_restarts=1,
        skip_tokenizer_init=True,
    ) as llm:
        ready = llm.engine.ready
        core = llm.engine.pid
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        first = workers_of(core)
        os.kill(max(first), signal.SIGKILL)
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.last_stats
        replaced = workers_of(core)
    assert ready.kv_segments == [None, None], "the plugin's pool is its own, not shared memory"
    assert after == before and stats.worker_restarts == 1
    assert stats.recovered_tokens == 0, "a pool of the backend's own does not survive its worker"
    assert not children_of(core) and not segments_of(core)

    calls = [line.split(" ", 2) + [""] for line in log.read_text().splitlines()]
    by_pid: dict[str, Counter] = {}
    details: dict[str, set] = {}
    for pid, hook, detail, *_ in calls:
        by_pid.setdefault(pid, Counter())[hook] += 1
        details.setdefault(hook, set()).add(detail)
    workers = {str(p) for p in first + replaced}
    assert workers <= set(by_pid), "every worker, first and replacement, asked the plugin"
    for pid in workers:
        asked = by_pid[pid]
        for hook in ("seed", "set_device", "distributed_backend", "default_dtype", "kv_cache_blocks"):
            assert asked[hook] >= 1, f"worker {pid} did not ask {hook}"
    assert details["set_device"] == {"rank=0 ranks_per_host=2", "rank=1 ranks_per_host=2"}
    assert details["default_dtype"] == {"auto->bfloat16"}
    memory_blocks = {int(d) for d in details["kv_cache_blocks"]}
    assert ready.num_blocks == min(memory_blocks), "the pool is what the plugin's memory query said"
    assert {"capture_graphs", "pin_memory", "graph_replay"} <= set(details), "graph and pinning hooks unused"


# --- the contract's version ---------------------------------------------------------------
SNAPSHOT = CHECKOUT / "tests" / "backend_contract.json"


def test_the_contract_surface_changes_only_with_a_new_version():
    recorded = json.loads(SNAPSHOT.read_text())
    current = surface()
    how = (
        "the backend contract changed: give it a new CONTRACT_VERSION (backends/platform.py), say "
        "what changed for ports under 'Contract versions' in docs/porting.md, then record it: "
        "python -m pagedllm.backends.contract > tests/backend_contract.json"
    )
    if current["version"] == recorded["version"]:
        assert current["members"] == recorded["members"], how
    assert current == recorded, how
    porting = (CHECKOUT / "docs" / "porting.md").read_text()
    assert f"**Version {CONTRACT_VERSION}**" in porting, "docs/porting.md says nothing of this version"


def test_a_backend_of_an_unknown_contract_version_is_refused_before_the_engine_starts(plugins_installed):
    with pytest.raises(BackendUnavailable, match=r"contract version 99; this pagedllm runs versions 1, 2, 3, 4, 5"):
        check_available("future-contract")
    with pytest.raises(BackendUnavailable, match="contract version 99"):
        LLM(backend="future-contract")
    check_available("version-one")  # the previous version runs on the platform defaults
    ops = load_backend("version-one")
    assert ops.distributed_backend == "gloo" and ops.kv_cache_blocks(None, 16, 1, 1, 1, 0.9, "cpu") is None
