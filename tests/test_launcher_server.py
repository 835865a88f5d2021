"""Engines whose launcher is forked by the session's launcher server (tests/conftest.py):
found there, replacing a killed worker, gone with its engine however the engine ends, and
refused when the engine's environment is not the server's."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.process.local_workers import LAUNCHER_SERVER_ENV

from proc_helpers import children_of, direct_children, parent_of, wait_until

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ENGINE = dict(num_kv_blocks=64, max_model_len=256, skip_tokenizer_init=True)


@pytest.fixture(autouse=True)
def listening(launcher_server):
    """The session's server binds its socket once it has imported torch: wait for it (an engine
    that starts before then gets a launcher of its own)."""
    path = os.environ[LAUNCHER_SERVER_ENV]
    assert wait_until(lambda: os.path.exists(path), timeout_s=60)


def tokens(llm: LLM) -> list[int]:
    return llm.generate([[5, 6, 7, 8]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_a_served_launcher_replaces_a_killed_worker_and_ends_with_its_engine(tiny_model, launcher_server):
    server = launcher_server.pid
    with LLM(tiny_model("llama"), max_worker_restarts=1, **ENGINE) as llm:
        core = llm.engine.pid
        assert not children_of(core), "the launcher is the server's child, not the core's"
        (launcher,) = direct_children(server)
        assert llm.engine.ready.launcher_pid == launcher
        (worker,) = children_of(launcher)
        # the launcher and its workers log where the core does
        assert os.readlink(f"/proc/{launcher}/fd/2") == os.readlink(f"/proc/{core}/fd/2")
        first = tokens(llm)
        os.kill(worker, signal.SIGKILL)
        assert tokens(llm) == first
        assert llm.last_stats.worker_restarts == 1
        (replacement,) = children_of(launcher)
        assert replacement != worker
    assert wait_until(lambda: not children_of(server), timeout_s=10)


def test_a_served_launcher_ends_with_a_killed_core(tiny_model, launcher_server):
    server = launcher_server.pid
    llm = LLM(tiny_model("llama"), **ENGINE)
    try:
        assert len(children_of(server)) == 2  # its launcher and its worker
        llm.engine.proc.kill()
        assert wait_until(lambda: not children_of(server), timeout_s=10)
    finally:
        llm.shutdown()


def test_an_engine_in_another_environment_starts_its_own_launcher(tiny_model, launcher_server, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TEST_ANOTHER_ENVIRONMENT", "1")  # any difference is refused
    with LLM(tiny_model("llama"), **ENGINE) as llm:
        assert not children_of(launcher_server.pid)
        assert len(children_of(llm.engine.pid)) == 2  # its launcher and its worker
        assert parent_of(llm.engine.ready.launcher_pid) == llm.engine.pid
        tokens(llm)


def test_the_server_socket_is_its_owners_alone():
    path = os.environ[LAUNCHER_SERVER_ENV]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_client_that_says_nothing_does_not_stall_the_server(tiny_model):
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(os.environ[LAUNCHER_SERVER_ENV])
    try:
        started = time.monotonic()
        with LLM(tiny_model("llama"), **ENGINE) as llm:
            assert parent_of(llm.engine.ready.launcher_pid) != llm.engine.pid, "the server forked its launcher"
            tokens(llm)
        assert time.monotonic() - started < 9  # the core's handshake gives up after 10 s
    finally:
        silent.close()
