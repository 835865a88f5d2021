"""`pagedllm serve` as an operator runs it: stopped by SIGTERM with streams in flight, and the
ZMQ socket locked with CurveZMQ keys made by `pagedllm keygen`."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest

from pagedllm.core.process.ipc import free_tcp_port
from pagedllm.entrypoints.zmq_client import AsyncZmqClient, ZmqClient, ZmqRequestError

from proc_helpers import is_running, segments_of, wait_until
from serve_helpers import ServerProcess

LONG = 8000  # tokens: far longer than the shutdown timeout allows, even on a fast CPU


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def long_model(tiny_model):
    return tiny_model("llama", max_position_embeddings=LONG + 64)


async def _openai_stream(url: str, model: str, max_tokens: int, started: asyncio.Event):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    tokens, reason = 0, None
    stream = await client.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return tokens, reason


async def _zmq_stream(endpoint: str, max_tokens: int, started: asyncio.Event):
    async with AsyncZmqClient(endpoint) as zc:
        final = None
        async for msg in zc.stream(prompt_token_ids=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True):
            started.set()
            final = msg
    return len(final.completions[0].token_ids), final.completions[0].finish_reason


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(long_model):
    # eager steps, and streams of 8,000 tokens: they must outlast the drain on a fast, quiet
    # machine too (a Zen 4 made 1,000 eager tokens of this tiny model a second). The drain is 2 s:
    # the late requests below must meet it still draining on a loaded machine too (at 1 s, a
    # third test process beside this one let it end before /health was asked)
    model = long_model
    srv = ServerProcess(model, "--num-kv-blocks", "1100", "--shutdown-timeout", "2", "--enforce-eager")

    async def main():
        started = [asyncio.Event() for _ in range(3)]
        tasks = [
            asyncio.create_task(_openai_stream(srv.url, model, LONG, started[0])),
            asyncio.create_task(_zmq_stream(srv.zmq_endpoint, LONG, started[1])),
            asyncio.create_task(_openai_stream(srv.url, model, 6, started[2])),
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.sleep(0.2)
        async with AsyncZmqClient(srv.zmq_endpoint) as late:  # draining: no new requests
            with pytest.raises(ZmqRequestError) as err:
                await late.generate(prompt="too late", max_tokens=2)
        assert err.value.code == 503 and "shutting down" in str(err.value)
        # HTTP still listens while draining: a new request gets 503, and so does /health
        assert (await asyncio.to_thread(srv.get, "/health"))[0] == 503
        late_http = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as http_err:
            await late_http.completions.create(model=model, prompt="too late", max_tokens=2)
        assert http_err.value.status_code == 503 and http_err.value.body["code"] == "shutting_down"
        await late_http.close()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return results, sent

    (http_long, zmq_long, short), sent = asyncio.run(main())
    assert short == (6, "length")
    for tokens, reason in (http_long, zmq_long):  # ended properly, with the reason, before the end
        assert reason == "abort" and tokens < LONG
    assert srv.proc.wait(timeout=30) == 0
    assert time.monotonic() - sent < 15
    assert wait_until(lambda: not any(is_running(p) for p in srv.engine_pids), timeout_s=10)
    assert not any(segments_of(p) for p in srv.engine_pids)


def _keygen(folder, name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "keygen", "--out", str(folder), "--name", name],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "key_secret" in out.stdout, out.stderr


def test_zmq_curve_lets_only_authorized_keys_through(model, tmp_path):
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    for name in ("server", "alice", "mallory"):
        _keygen(keys, name)
    authorized.mkdir()
    shutil.copy(keys / "alice.key", authorized / "alice.key")
    assert (keys / "alice.key_secret").stat().st_mode & 0o077 == 0, "a secret key readable by others"
    srv = ServerProcess(
        model,
        "--num-kv-blocks",
        "64",
        "--zmq-curve-secret-key",
        str(keys / "server.key_secret"),
        "--zmq-authorized-keys",
        str(authorized),
    )
    try:
        with ZmqClient(
            srv.zmq_endpoint,
            timeout_s=20,
            server_key=str(keys / "server.key"),
            client_key=str(keys / "alice.key_secret"),
        ) as alice:
            assert alice.wait_ready().model == model
            assert alice.generate(prompt="hello", max_tokens=3).usage.completion_tokens == 3
        strangers = [
            ZmqClient(
                srv.zmq_endpoint,
                timeout_s=2,
                server_key=str(keys / "server.key"),
                client_key=str(keys / "mallory.key_secret"),
            ),
            ZmqClient(srv.zmq_endpoint, timeout_s=2),  # no keys at all
        ]
        for stranger in strangers:
            with stranger, pytest.raises(TimeoutError):
                stranger.generate(prompt="hello", max_tokens=3)
    finally:
        srv.stop()


def test_a_zmq_endpoint_other_hosts_can_reach_is_refused_without_keys(model):
    endpoint = f"tcp://0.0.0.0:{free_tcp_port()}"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--zmq-endpoint", endpoint]
    t0 = time.monotonic()
    out = subprocess.run([*cmd, "--port", str(free_tcp_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--zmq-allow-insecure" in out.stderr and "pagedllm keygen" in out.stderr
    assert time.monotonic() - t0 < 30, "refused only after starting the engine"
