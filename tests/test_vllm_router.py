"""vllm-router (the vLLM project's Rust router, from PyPI) in front of two `pagedllm serve`
processes on loopback: its kv_aware policy reads their KV events (--kv-events-config) and
sends a conversation's next turn where its prefix is cached; its round_robin policy does not.
Multi-turn chats through it with the `openai` client: every answer equals one engine's
(greedy), and the follow-up turns' prefix-cache hits are counted under both policies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedllm.core.process.ipc import free_tcp_port

from proc_helpers import wait_until
from serve_helpers import ServerProcess, chat_turns, client, conversations

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
pytestmark = pytest.mark.skipif(
    not Path(ROUTER).exists(), reason="vllm-router is not installed (pip install vllm-router)"
)


@pytest.fixture(scope="module")
def workers(tiny_model):
    model = tiny_model("llama")

    def start(_):
        events, replay = free_tcp_port(), free_tcp_port()
        config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events}", '
        config += f'"replay_endpoint": "tcp://*:{replay}"}}'
        server = ServerProcess(model, "--kv-events-config", config, "--zmq-endpoint", "none")
        return server, events, replay

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
    yield model, started
    for server, _, _ in started:
        server.stop()


class Router:
    def __init__(self, workers, policy: str, model: str):
        self.port = free_tcp_port()
        cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_tcp_port())]
        cmd += ["--worker-urls", *(s.url for s, _, _ in workers), "--policy", policy, "--log-level", "warning"]
        if policy == "kv_aware":
            for server, events, replay in workers:
                cmd += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{events}"]
                cmd += ["--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay}"]
            cmd += ["--kv-event-block-size", "16", "--kv-event-model", model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

        def up():
            try:
                return urllib.request.urlopen(self.url + "/health", timeout=1).status == 200
            except OSError:
                return False

        assert wait_until(up, timeout_s=30), "vllm-router did not start"

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return out


def test_vllm_router_kv_aware_sends_each_turn_to_its_cached_prefix(workers):
    model, started = workers
    hit_rates, routed = {}, {}
    for policy in ("kv_aware", "round_robin"):
        router = Router(started, policy, model)
        try:
            routed[policy], cached = conversations(chat_turns(client(router), model), tag=policy)
        finally:
            log = router.stop()
        assert "kv_index decode batch" not in log, log  # the router read our events cleanly
        hit_rates[policy] = sum(c > 0 for c in cached) / len(cached)
    for policy, answers in routed.items():  # greedy: the same whichever engine answered
        assert answers == conversations(chat_turns(client(started[0][0]), model), tag=policy)[0], policy
    print(f"follow-up turns with a prefix-cache hit: {hit_rates}")
    assert hit_rates["kv_aware"] >= 0.9 and hit_rates["round_robin"] < hit_rates["kv_aware"]
