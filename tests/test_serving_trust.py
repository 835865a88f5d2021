"""`pagedllm serve` against hostile, careless and vLLM-minded clients: no request may stop the
engine or an entrypoint, every refusal names the field the client sent, no traceback reaches
a client, and the OpenAI surface that clients written for vLLM's server use.

The server is test_serving.py's (conftest's `served`). Its processes start with a
sitecustomize that plants one bug in the engine core: a beam search with length_penalty 4.25
raises in its step, as an unbounded length_penalty once did (OverflowError) — the way to check
that an error in the core's handling of one request fails that request alone. Its model's chat
template refuses conversations whose roles do not alternate."""

from __future__ import annotations

import json
import socket
import time

import msgspec
import openai
import pytest

from pagedllm.entrypoints.zmq_client import ZmqClient, ZmqRequestError
from pagedllm.entrypoints.zmq_protocol import Error, Final, Ready

from serve_helpers import PLANTED_PENALTY, client, post


@pytest.fixture(scope="module")
def model(served):
    return served[1]


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def assert_serving(server, model) -> None:
    """/health is 200 and a request is answered on both surfaces."""
    assert server.get("/health")[0] == 200
    assert client(server).completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc:
        assert zc.generate(prompt="hi", max_tokens=2).usage.completion_tokens == 2


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and ".py" not in text, text


# --- a request that would kill the engine or an entrypoint ---------------------------------
@pytest.mark.parametrize("penalty", [400, 1e308, -1e308])
def test_a_huge_length_penalty_is_refused_and_the_engine_serves_on(server, model, penalty):
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "use_beam_search": True, "best_of": 3}
    status, reply = post(server, "/v1/completions", {**body, "length_penalty": penalty})
    assert status == 400 and reply["error"]["param"] == "length_penalty", reply
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc, pytest.raises(ZmqRequestError) as e:
        zc.generate(prompt="hi", max_tokens=4, beam_width=2, length_penalty=penalty)
    assert e.value.code == 400 and e.value.field == "params.length_penalty"
    assert_serving(server, model)


def test_an_error_in_the_engine_core_fails_that_request_alone(server, model):
    """The planted bug raises in the core while it handles one beam search: that request gets a
    500 without a traceback, the one beside it finishes, and the engine serves on."""
    with ZmqClient(server.zmq_endpoint, timeout_s=30) as zc:
        beside = zc.stream(prompt_token_ids=[5, 6, 7], max_tokens=40, temperature=0.0, ignore_eos=True)
        next(beside)
        body = {"model": model, "prompt": "hi", "max_tokens": 4, "use_beam_search": True, "best_of": 2}
        status, reply = post(server, "/v1/completions", {**body, "length_penalty": PLANTED_PENALTY})
        assert status == 500 and reply["error"]["code"] == "request_failed", reply
        no_traceback(reply["error"]["message"])
        with pytest.raises(ZmqRequestError) as e:
            zc.generate(prompt="hi", max_tokens=4, beam_width=2, length_penalty=PLANTED_PENALTY)
        assert e.value.code == 500
        no_traceback(str(e.value))
        final = list(beside)[-1]
        assert isinstance(final, Final) and len(final.completions[0].token_ids) == 40
    assert_serving(server, model)


@pytest.mark.parametrize(
    "frame", [b"\x91" * 1000 + b"\xc0", b"\x81\xa1a" * 1000 + b"\xc0", b"\x81\xa4type" + b"\x91" * 5000 + b"\xc0"]
)
def test_a_nesting_bomb_frame_gets_an_error_and_the_zmq_socket_serves_on(server, model, frame):
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc:
        zc.send_raw(frame)
        reply = zc.receive_any()
        assert isinstance(reply, Error) and reply.code == 400 and reply.message
        assert isinstance(zc.wait_ready(), Ready)
    assert_serving(server, model)


@pytest.mark.parametrize(
    "body,field",
    [
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt[0][0][0]..."),
        (b'{"prompt": "hi", "extra": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}", "extra.a.a.a..."),
        (b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", None),
        (b'{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', "stop_token_ids"),
        (b'{"prompt": "hi", "max_tokens": 18446744073709551616}', "max_tokens"),
        (b'{"prompt": "hi", "top_k": -18446744073709551616}', "top_k"),
        (b'{"prompt": "hi", "\xff\xfe": 1}', "\ufffd\ufffd"),
        (b'{"prompt": "hi", "user": "\xc3\x28"}', "user"),
    ],
)
def test_malformed_json_is_a_400_naming_the_field(server, model, body, field):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, reply = post(server, path, body)
    assert status == 400, reply
    expected = field or "messages[0].content[0]"  # typed: refused as a wrong type before it nests
    assert reply["error"]["param"] == expected, reply
    no_traceback(reply["error"]["message"])


def test_a_chat_template_that_refuses_the_conversation_is_a_400_with_its_message(server, model):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], max_tokens=2
        )
    assert e.value.body["param"] == "messages" and "Conversation roles must alternate" in e.value.body["message"]
    # a role the template takes, though OpenAI's API does not know it
    out = c.chat.completions.create(
        model=model,
        messages=[{"role": "critic", "content": "a"}, {"role": "user", "content": "b"}],
        max_tokens=2,
        extra_body={"ignore_eos": True},  # the random model's first token may be its EOS
    )
    assert out.usage.completion_tokens == 2


# --- errors name what the client sent ------------------------------------------------------
@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"use_beam_search": True, "best_of": 11}, "best_of"),
        ("/v1/completions", {"use_beam_search": True, "best_of": 0}, "best_of"),
        ("/v1/completions", {"use_beam_search": True, "n": 0}, "n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": -5}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"truncation_side": "middle"}, "truncation_side"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"n": 64, "logprobs": 20, "max_tokens": 500}, "logprobs"),  # ~0.7M entries a prompt
    ],
)
def test_refusals_name_the_field_the_client_sent(server, model, path, extra, param):
    body = {"model": model, **extra}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = ["a", "b"] if param == "logprobs" else "hi"
    status, reply = post(server, path, body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_body_that_is_not_json_is_a_415(server, model):
    status, reply = post(server, "/v1/completions", b"prompt=hi", content_type="application/x-www-form-urlencoded")
    assert status == 415 and reply["error"]["code"] == "unsupported_media_type"


def test_clients_that_hang_up_are_not_logged_as_errors(server, model):
    before = len(server.output)
    # HTTP: a body promised and never sent in full
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"prompt": "'
        )
        time.sleep(0.3)
    # ZMQ: a streaming client that vanishes mid-stream (no abort: its connection just drops)
    zc = ZmqClient(server.zmq_endpoint, timeout_s=20)
    zc.send_raw(
        msgspec.msgpack.encode(
            {
                "type": "generate",
                "request_id": "gone",
                "prompt_token_ids": [5, 6, 7],
                "params": {"max_tokens": 200, "ignore_eos": True},
            }
        )
    )
    assert zc.receive_any().request_id == "gone"
    zc.close()
    time.sleep(1.0)  # the server notices when it next sends to it
    assert_serving(server, model)
    logged = "".join(server.output[before:])
    assert "ERROR" not in logged and "Traceback" not in logged, logged


# --- what clients written for vLLM's server expect ----------------------------------------
def test_completion_logprobs_include_the_sampled_token(server, model):
    c = client(server)
    for k in (0, 1, 3):
        out = c.completions.create(model=model, prompt="The quick", max_tokens=6, temperature=1.0, seed=5, logprobs=k)
        lp = out.choices[0].logprobs
        for token, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
            assert top[token] == value and len(top) <= k + 1
        if k == 0:
            assert all(len(top) == 1 for top in lp.top_logprobs)


def test_beam_search_reports_length_and_returns_n_beams(server, model):
    c = client(server)
    out = c.completions.create(
        model=model,
        prompt="Once upon",
        max_tokens=5,
        n=2,
        temperature=0,
        best_of=3,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert [ch.index for ch in out.choices] == [0, 1]
    assert [ch.finish_reason for ch in out.choices] == ["length", "length"]
    assert out.choices[0].text != out.choices[1].text and out.usage.completion_tokens == 10


def test_prompt_logprobs_echo_and_cached_tokens(server, model):
    c = client(server)
    prompt = "The quick brown fox jumps over the lazy dog, twice over the lazy dog"
    plain = c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None  # present, null
    again = c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    scored = c.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == scored.usage.prompt_tokens
    assert all(1 <= len(e) <= 2 for e in entries[1:])
    # how evaluation harnesses score a text: echo, logprobs, nothing generated
    echo = c.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = echo.choices[0]
    assert choice.text == prompt and echo.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert "".join(choice.logprobs.tokens) == prompt
    for p, entry in enumerate(entries[1:], start=1):  # the same numbers either way
        assert min(lp["logprob"] for lp in entry.values()) <= choice.logprobs.token_logprobs[p] + 1e-5
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "prompt_logprobs" in chat.model_extra and chat.model_extra["prompt_logprobs"] is None


def test_continuous_usage_token_ids_and_truncation(server, model):
    c = client(server)
    chunks = list(
        c.completions.create(
            model=model,
            prompt=[5, 6, 7, 8, 9, 10],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3, "ignore_eos": True},
        )
    )
    assert all(ch.usage is not None and ch.usage.prompt_tokens == 3 for ch in chunks)
    assert chunks[-1].usage.completion_tokens == 4
    assert next(ch.choices[0].model_extra.get("prompt_token_ids") for ch in chunks if ch.choices) == [8, 9, 10]
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    whole = c.completions.create(
        model=model,
        prompt=[8, 9, 10],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert whole.choices[0].model_extra["token_ids"] == ids and len(ids) == 4
    right = c.completions.create(
        model=model,
        prompt=[5, 6, 7, 8, 9, 10],
        max_tokens=1,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 2, "truncation_side": "right"},
    )
    assert right.choices[0].model_extra["prompt_token_ids"] == [5, 6]


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_counts_each_chunks_own_tokens(server, model, kind):
    """As vLLM's clients check it: every chunk with a choice counts more tokens than the chunk
    before (the count is the chunk's own, not where the request has got to meanwhile), every
    completions chunk counts at least one; the usage-only chunk at the end repeats the total.
    Without include_usage there is no usage at all, continuous_usage_stats or not."""
    c = client(server)
    common = dict(model=model, temperature=0, stream=True, extra_body={"ignore_eos": True, "min_tokens": 10})
    if kind == "chat":
        create = c.chat.completions.create
        common.update(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10)
    else:
        create = c.completions.create
        common.update(prompt="What is the capital of France?", max_tokens=10)
    for _ in range(3):
        chunks = list(create(**common, stream_options={"include_usage": True, "continuous_usage_stats": True}))
        counts = [(bool(ch.choices), ch.usage.completion_tokens) for ch in chunks]
        with_choices = [n for has, n in counts if has]
        if kind == "chat":
            assert with_choices[0] == 0  # the role's chunk
            with_choices = with_choices[1:]
        assert with_choices == sorted(set(with_choices)) and with_choices[0] > 0, counts
        assert counts[-1] == (False, 10) and with_choices[-1] == 10, counts
        assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
    quiet = list(create(**common, stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in quiet)


def test_vllm_wording_of_an_empty_prompt_an_unknown_token_and_a_seed_out_of_range(server, model):
    """The words clients of vLLM's server match on; stop_token_ids out of the vocabulary too."""
    c = client(server)
    with pytest.raises(
        openai.BadRequestError, match=r"Either prompt or prompt_embeds must be provided and non-empty\."
    ):
        c.completions.create(model=model, prompt=None, max_tokens=5, extra_body={"prompt_embeds": []})
    for prompt in ("", []):
        with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds"):
            c.completions.create(model=model, prompt=prompt, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as e:
        c.completions.create(model=model, prompt=[999999], max_tokens=5)
    assert e.value.body["param"] == "prompt_token_ids"
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as e:
        c.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [3, 999999]})
    assert e.value.body["param"] == "stop_token_ids"
    for seed, word in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        with pytest.raises(openai.BadRequestError, match=word) as e:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], seed=seed)
        assert e.value.body["param"] == "seed"
    assert c.completions.create(model=model, prompt="hi", max_tokens=2, seed=2**63 - 1).usage.completion_tokens == 2
    assert_serving(server, model)


def test_min_tokens_holds_back_stop_strings(server, model):
    c = client(server)
    free = c.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[:2]  # would stop at once
    held = c.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "min_tokens": 12},
    )
    assert held.choices[0].finish_reason == "length" and held.choices[0].text == text


def test_version(server):
    status, body = server.get("/version")
    reply = json.loads(body)
    assert status == 200 and reply["version"]
    # the cpu backend promises a request the same bits whatever runs beside it (its invariance rows)
    assert reply["backend"] == "cpu" and reply["batch_invariant"] is True


def test_zmq_prompt_logprobs_and_cached_tokens(server):
    """A prefix hit is reported, also for a request that ends at its first token (the engine
    core once looked the hit up after the request had gone, and said 0)."""
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc:
        final = zc.generate(prompt_token_ids=list(range(5, 45)), max_tokens=2, prompt_logprobs=2, temperature=0)
        assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == 40
        assert all(len(top) == 2 for top in final.prompt_top_logprobs[1:])
        again = zc.generate(prompt_token_ids=list(range(5, 45)), max_tokens=2, temperature=0)
        assert again.usage.cached_tokens > 0
        first = again.completions[0].token_ids[0]
        stopped = zc.generate(prompt_token_ids=list(range(5, 45)), max_tokens=2, temperature=0, stop_token_ids=[first])
        assert stopped.completions[0].token_ids == [first] and stopped.usage.cached_tokens > 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(final))  # plain msgpack for other languages


def test_health_is_503_once_the_zmq_entrypoint_has_stopped():
    """Should the ZMQ socket loop ever end (here: its receive fails), /health must not go on
    saying 200 while half the server is dead."""
    import asyncio
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from pagedllm.entrypoints.openai_server import OpenAIServer
    from pagedllm.entrypoints.zmq_server import ZmqServer

    engine = SimpleNamespace(dead_reason=None, recovering=None, max_model_len=16)
    zmq_server = ZmqServer(engine, "tcp://127.0.0.1:*")
    app = OpenAIServer(engine, "m", health_checks=[lambda: zmq_server.dead_reason]).app
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200

        async def broken_receive():
            raise OSError("the socket broke")

        async def break_it():
            zmq_server.sock.recv_multipart = broken_receive
            await asyncio.gather(zmq_server.serve(), return_exceptions=True)

        asyncio.run(break_it())
        reply = http.get("/health")
        assert reply.status_code == 503 and "ZMQ entrypoint stopped" in reply.text
    zmq_server.close()
