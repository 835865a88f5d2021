"""Faults: a dying worker and Ctrl-C leave no processes or shared-memory segments behind."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.engine_client import EngineDeadError

from proc_helpers import children_of, is_running, segments_of, wait_until, workers_of

# the faults on the default path: a worker launcher that is the core's own child
pytestmark = pytest.mark.usefixtures("own_launcher")


def test_killed_worker_without_restarts_left_raises_quickly_and_leaves_nothing(tiny_model):
    """With no restarts allowed (max_worker_restarts=0), a dead worker ends the engine; with
    restarts, test_worker_recovery.py shows it replaced."""
    llm = LLM(tiny_model("llama"), num_kv_blocks=512, max_model_len=1024, max_worker_restarts=0)
    core_pid = llm.engine.pid
    (worker_pid,) = workers_of(core_pid)
    assert segments_of(core_pid), "the cpu backend's KV pool should be a shared-memory segment"
    killed_at = {}

    def kill():
        killed_at["t"] = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(EngineDeadError, match=r"worker 0 \(pid \d+\) was killed by SIGKILL; 0 of 0 restarts"):
        llm.generate([[5] * 50] * 64, SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
    elapsed = time.monotonic() - killed_at["t"]
    assert elapsed <= 5.0, f"took {elapsed:.1f} s to notice the dead worker"
    llm.shutdown()
    assert core_pid not in children_of(os.getpid()) and not children_of(core_pid)
    assert not segments_of(core_pid)
    assert not os.path.exists(llm.engine.ipc_dir), "socket files left behind"
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6]], use_tqdm=False)


def test_sigint_on_pagedllm_generate_cleans_up(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [5 + i] * 40}) + "\n" for i in range(64)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "generate",
            "--model",
            tiny_model("llama"),
            "--input",
            str(prompts),
            "--max-tokens",
            "900",
            "--ignore-eos",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "64MiB",
            "--output",
            str(tmp_path / "out.jsonl"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # running once the engine core has its KV segment and the worker is computing
        assert wait_until(lambda: any(segments_of(p) for p in children_of(proc.pid)), timeout_s=60)
        time.sleep(1.0)
        engine_pids = children_of(proc.pid)
        core_pid = next(p for p in engine_pids if segments_of(p))
        engine_pids += children_of(core_pid) + workers_of(core_pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert wait_until(lambda: not [p for p in engine_pids if is_running(p)], timeout_s=5), (
        "engine processes outlived the CLI"
    )
    assert not segments_of(core_pid)


FRONTEND = """
import sys, time
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=512, max_model_len=1024, skip_tokenizer_init=True)
print(llm.engine.pid, llm.engine.ipc_dir, flush=True)
llm.generate([[5] * 50] * 32, SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("when", ["idle", "generating"])
def test_a_killed_frontend_takes_the_engine_with_it(tiny_model, when):
    """SIGKILL on the frontend (nothing runs its shutdown): the engine core notices — idle, or
    when its next output finds nobody to receive it — and the core, the worker, the KV
    segment and the socket folder all go."""
    script = FRONTEND if when == "generating" else FRONTEND.replace("llm.generate", "time.sleep(60) or llm.generate")
    front = subprocess.Popen([sys.executable, "-c", script, tiny_model("llama")], stdout=subprocess.PIPE, text=True)
    core_pid, ipc_dir = front.stdout.readline().split()
    core_pid = int(core_pid)
    engine_pids = [core_pid] + children_of(core_pid) + workers_of(core_pid)
    assert segments_of(core_pid) and workers_of(core_pid)
    time.sleep(1.0)  # generating (or idle) for a while
    front.kill()
    front.wait()
    alive = lambda: [p for p in engine_pids if is_running(p)]
    assert wait_until(lambda: not alive(), timeout_s=20), f"engine processes outlived their frontend: {alive()}"
    assert not segments_of(core_pid), "the KV segment outlived the engine"
    assert not os.path.exists(ipc_dir), "the socket folder outlived the engine"
