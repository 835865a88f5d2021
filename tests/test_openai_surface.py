"""`pagedllm serve`'s options that vLLM's server has and its clients use: server-load tracking
(GET /load), SageMaker's /invocations, usage forced onto every streamed chunk — through the real
openai client and raw HTTP."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from serve_helpers import ServerProcess


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "",
        "--max-model-len",
        "512",
        "--enable-server-load-tracking",
        "--enable-force-include-usage",
        "--zmq-endpoint",
        "none",
    )
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def load(server) -> int:
    status, body = server.get("/load")
    assert status == 200
    return json.loads(body)["server_load"]


def settles_at(server, value: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if load(server) == value:
            return True
        time.sleep(0.02)
    return False


def test_load_counts_the_requests_being_answered_streamed_or_not(server):
    c = client(server)
    model = c.models.list().data[0].id
    assert load(server) == 0
    stream = c.completions.create(model=model, prompt="Give me a long story", max_tokens=400, stream=True)
    next(iter(stream))  # its first token: the other 399 take a while yet
    assert load(server) == 1
    stream.close()  # the client leaves mid-stream: the request is aborted and no longer counted
    assert settles_at(server, 0)
    answered = threading.Thread(
        target=c.completions.create, kwargs=dict(model=model, prompt="A list", max_tokens=450, n=4, temperature=1)
    )
    answered.start()
    seen = set()
    while answered.is_alive():
        seen.add(load(server))
        time.sleep(0.01)
    assert 1 in seen and seen <= {0, 1}, seen
    assert settles_at(server, 0)
    post(server, "/v1/completions", {"prompt": [999999], "max_tokens": 2})  # refused: counted and uncounted
    assert load(server) == 0


def test_invocations_answer_as_the_route_the_body_names(server):
    c = client(server)
    model = c.models.list().data[0].id
    chat_body = {
        "messages": [{"role": "user", "content": "what is 1+1?"}],
        "max_completion_tokens": 5,
        "temperature": 0,
    }
    chat = c.chat.completions.create(model=model, **chat_body).model_dump(exclude_unset=True)
    status, invoked = post(server, "/invocations", chat_body)
    assert status == 200 and invoked["object"] == "chat.completion"
    assert invoked.keys() == chat.keys() and invoked["choices"] == chat["choices"]
    status, invoked = post(server, "/invocations", {"prompt": "A list is", "max_tokens": 4, "temperature": 0})
    plain = c.completions.create(model=model, prompt="A list is", max_tokens=4, temperature=0)
    assert status == 200 and invoked["choices"][0]["text"] == plain.choices[0].text
    status, error = post(server, "/invocations", {"input": "neither"})
    assert status == 400 and "messages" in error["error"]["message"]
    status, error = post(server, "/invocations", {"messages": [], "max_tokens": "x"})
    assert status == 400 and error["error"]["param"] == "max_tokens"


def test_forced_usage_is_on_every_chunk_and_counts_up(server):
    """vLLM's --enable-force-include-usage: a stream that asked for no usage gets it on every
    chunk, counting each chunk's own tokens, and a usage-only chunk at the end."""
    c = client(server)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = c.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": 10},
    )
    counts = [(bool(ch.choices), ch.usage.completion_tokens) for ch in stream]
    tokens = [n for has, n in counts if has]
    assert tokens[0] == 0 and tokens[1:] == sorted(set(tokens[1:])) and counts[-1] == (False, 10), counts
    chunks = list(c.completions.create(model=model, prompt="A list", max_tokens=5, stream=True))
    assert all(ch.usage is not None and ch.usage.completion_tokens > 0 for ch in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
