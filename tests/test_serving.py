"""`pagedllm serve` as users meet it: the real openai client over HTTP, the ZMQ client, many
at once, clients that vanish, malformed input, metrics, keys and limits."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import urllib.request

import msgspec
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.zmq_client import AsyncZmqClient, ZmqClient, ZmqRequestError
from pagedllm.entrypoints.zmq_protocol import Error, Final

from proc_helpers import children_of, segments_of, wait_until
from serve_helpers import SERVED_MAX_MODEL_LEN as MAX_MODEL_LEN
from serve_helpers import ServerProcess, client


@pytest.fixture(scope="module")
def model(served):
    return served[1]


@pytest.fixture(scope="module")
def server(served):  # conftest's, shared with test_serving_trust.py (the same MAX_MODEL_LEN)
    return served[0]


def test_openai_client_completions_chat_streaming_and_n(server, model):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [model]
    full = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    streamed = list(
        c.completions.create(
            model=model,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(streamed) > 2  # token by token
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == full.choices[0].text
    assert streamed[-1].usage.completion_tokens == 12 and streamed[-1].choices == []

    chat = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    chunks = list(
        c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content

    two = c.completions.create(model=model, prompt="Once upon", max_tokens=8, n=2, temperature=1.0, seed=7, logprobs=2)
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.usage.completion_tokens == 16
    for ch in two.choices:  # each position: the sampled token and the two most likely (keyed by text)
        assert len(ch.logprobs.token_logprobs) == 8
        assert all(1 <= len(top) <= 3 for top in ch.logprobs.top_logprobs)
        assert all(t in top for t, top in zip(ch.logprobs.tokens, ch.logprobs.top_logprobs))
    again = c.completions.create(model=model, prompt="Once upon", max_tokens=8, n=2, temperature=1.0, seed=7)
    assert [ch.text for ch in again.choices] == [ch.text for ch in two.choices]  # seeded

    beam = c.completions.create(
        model=model, prompt="Once upon", max_tokens=5, temperature=0, best_of=3, extra_body={"use_beam_search": True}
    )
    assert beam.usage.completion_tokens == 5


async def _http_stream(aclient, model, ids, max_tokens, leave_after=None):
    text, n = "", 0
    stream = await aclient.completions.create(
        model=model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": leave_after is not None},
    )
    async for chunk in stream:
        text += chunk.choices[0].text
        n += 1
        if leave_after is not None and n >= leave_after:
            await stream.close()  # the client goes away mid-stream
            return None
    return text


async def _zmq_stream(endpoint, ids, max_tokens, leave_after=None):
    zc = AsyncZmqClient(endpoint)
    tokens, n = [], 0
    try:
        async for msg in zc.stream(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=leave_after is not None
        ):
            if isinstance(msg, Final):
                assert msg.completions[0].token_ids == tokens
                return tokens
            tokens += msg.token_ids
            n += 1
            if leave_after is not None and n >= leave_after:
                return None
    finally:
        # a vanishing client: no abort message, the connection just drops
        await zc.close(abort=leave_after is None)


async def _zmq_abort(endpoint, ids, after: int, n: int = 1):
    """A client that aborts its request after `after` deltas and reads the Final. Its answer is
    long (300 tokens) so the abort lands before the end even when 72 clients on one event loop
    read their deltas late (with 150, a request of n = 2 once finished first)."""
    async with AsyncZmqClient(endpoint) as zc:
        seen, final = 0, None
        async for msg in zc.stream(prompt_token_ids=ids, max_tokens=300, n=n, ignore_eos=True, request_id=f"a{after}"):
            if isinstance(msg, Final):
                final = msg
                break
            seen += 1
            if seen == after:
                zc.abort(msg.request_id)
        return [c.finish_reason for c in final.completions]


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_64_concurrent_clients_match_offline_and_leavers_free_their_blocks(server, model):
    """The load test: 48 streaming clients over HTTP and ZMQ, 16 that vanish mid-stream, 8 that
    abort (some a request of n = 2); afterwards nothing is left behind: blocks, requests,
    processes, shared-memory segments, sockets."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(4, 60))] for _ in range(48)]
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    with LLM(model, num_kv_blocks=400, max_model_len=MAX_MODEL_LEN, kv_cache_dtype="int8") as llm:
        offline = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
            use_tqdm=False,
        )
    before = server.metrics()
    aborts_before = before.get("pagedllm:request_success_total{finished_reason=abort}", 0)
    fds_before = _open_fds(server.proc.pid)
    processes_before = set(children_of(server.proc.pid))
    segments_before = {pid: segments_of(pid) for pid in server.engine_pids}

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        jobs = []
        for i, (ids, m) in enumerate(zip(prompts, max_tokens)):
            jobs.append(
                _http_stream(aclient, model, ids, m) if i % 2 == 0 else _zmq_stream(server.zmq_endpoint, ids, m)
            )
        for i in range(16):  # 8 over each protocol leave after a few chunks of a long answer
            ids = [rng.randrange(3, 400) for _ in range(30)]
            jobs.append(
                _http_stream(aclient, model, ids, 400, leave_after=3)
                if i % 2 == 0
                else _zmq_stream(server.zmq_endpoint, ids, 400, leave_after=3)
            )
        for i in range(8):  # an explicit abort mid-stream, of one completion or of two
            ids = [rng.randrange(3, 400) for _ in range(40 if i % 2 else 200)]
            jobs.append(_zmq_abort(server.zmq_endpoint, ids, after=2 if i % 2 else 1, n=1 if i % 2 else 2))
        results = await asyncio.gather(*jobs)
        await aclient.close()
        return results

    results = asyncio.run(main())
    for reasons in results[64:]:
        assert set(reasons) == {"abort"}, reasons
    results = results[:64]
    for i, (got, want) in enumerate(zip(results[:48], offline)):
        if i % 2 == 0:
            assert got == want.outputs[0].text, f"HTTP client {i}"
        else:
            assert got == want.outputs[0].token_ids, f"ZMQ client {i}"
    assert results[48:] == [None] * 16
    assert wait_until(lambda: server.metrics()["pagedllm:num_requests_running"] == 0, timeout_s=20, interval=0.1), (
        "requests still running"
    )
    after = server.metrics()
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0  # every block back (cached ones count as free)
    assert wait_until(lambda: _open_fds(server.proc.pid) <= fds_before, timeout_s=10, interval=0.1), (
        f"sockets left open: {_open_fds(server.proc.pid)} descriptors, {fds_before} before"
    )
    assert set(children_of(server.proc.pid)) == processes_before
    assert {pid: segments_of(pid) for pid in server.engine_pids} == segments_before
    assert after["pagedllm:kv_table_mean_run_blocks"] >= 1  # tables were live while it was sampled
    assert 0 <= after["pagedllm:kv_internal_waste_perc"] < 1 and "pagedllm:kv_external_fragmentation_perc" in after
    # per completion: the 16 that vanished, 4 aborted alone, 4 aborted with n = 2 (each counted once
    # its entrypoint has closed the stream, which may come after the engine's last stats)
    aborted = "pagedllm:request_success_total{finished_reason=abort}"
    assert wait_until(lambda: server.metrics().get(aborted, 0) - aborts_before >= 16 + 4 + 4 * 2, timeout_s=10)
    assert server.metrics()[aborted] - aborts_before == 16 + 4 + 4 * 2
    assert after["pagedllm:num_requests_waiting"] == 0


def _fuzz_bodies(rng: random.Random, model: str) -> list[bytes]:
    valid = {"model": model, "prompt": "hello", "max_tokens": 4}
    wrong_type = ["x", [], {}, [[]], [1.5], {"a": 1}]
    out_of_range = {  # field -> values that are the right type but outside the allowed range
        "max_tokens": [-1, 0, 10**30, -(10**30)],
        "temperature": [-0.5, 1e308 * 10, -1e308],
        "top_p": [0, 1.5, -1],
        "n": [0, -1, 10**20],
        "logprobs": [-1, 21, 10**9],
        "seed": [2**64, -(2**70)],
        "presence_penalty": [3, -2.5],
        "frequency_penalty": [9e9],
        "top_k": [-2, -(10**25)],
        "min_p": [1.5, -0.1],
        "min_tokens": [-4, 10**6],
        "best_of": [3, -1],
        "logit_bias": [{"5": 101}, {"5": -1e308}, {"x": 1}, {"-1": 1}, {"1e3": 1}, {"5": True}, {"100000": 1}],
        "stop_token_ids": [[-5]],
        "repetition_penalty": [0, -1],
        "stop": [[""], ["ok", ""]],
    }
    bodies = []
    fields = sorted(out_of_range)
    while len(bodies) < 70:
        field = rng.choice(fields)
        value = rng.choice(out_of_range[field] + wrong_type)
        if (field, json.dumps(value)) in {
            ("logit_bias", "{}"),
            ("stop", "[]"),
            ("stop", '"x"'),
            ("stop_token_ids", "[]"),
        }:
            continue  # these happen to be valid
        bodies.append(json.dumps({**valid, field: value}).encode())
    bodies += [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe\x00garbage",
        b'{"prompt": "\xff\xfe"}',
        b'{"max_tokens": 4}',
        json.dumps({"model": model, "prompt": "x " * 2000, "max_tokens": 4}).encode(),  # over max_model_len
        json.dumps({"model": model, "prompt": [7] * MAX_MODEL_LEN}).encode(),
        json.dumps({"model": model, "prompt": [100000]}).encode(),  # token id outside the vocabulary
        # logit_bias extremes: a huge map past the vocabulary, NaN and infinities (not JSON, but sent)
        json.dumps({"model": model, "prompt": "hi", "logit_bias": {str(t): 1.0 for t in range(200_000)}}).encode(),
        b'{"prompt": "hi", "logit_bias": {"5": NaN}}',
        b'{"prompt": "hi", "logit_bias": {"5": Infinity}}',
        b'{"prompt": "hi", "logit_bias": {"5": 1e999}}',
        json.dumps({"model": model, "prompt": "hi", "max_tokens": 10**9}).encode(),
        json.dumps({"model": model, "prompt": "hi", "n": 0}).encode(),
        json.dumps({"model": model, "prompt": "hi", "logprobs": 1000}).encode(),
        json.dumps({"model": model, "prompt": [[1, 2], "x", 3]}).encode(),
        json.dumps({"model": model, "prompt": []}).encode(),
        json.dumps({"model": model, "prompt": "hi", "stop": [""]}).encode(),
        json.dumps({"model": model, "prompt": "hi", "n": 65}).encode(),  # over --max-n (= max_num_seqs 64)
        json.dumps({"model": model, "prompt": "hi", "stop": [f"s{i}" for i in range(17)]}).encode(),
        json.dumps({"model": model, "prompt": ["a"] * 65}).encode(),  # over --max-prompts
        json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
        bytes(rng.randrange(256) for _ in range(64)),
        b'{"model": "m", "prompt": "hi", "max_tokens": 99999999999999999999999999}',
        b'{"prompt": "hi", "temperature": NaN}',
    ]
    while len(bodies) < 100:
        bodies.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))))
    return bodies


def _fuzz_frames(rng: random.Random) -> list[list[bytes]]:
    enc = msgspec.msgpack.encode
    valid = {"type": "generate", "request_id": "r", "prompt": "hi", "params": {"max_tokens": 4}}
    frames = []
    mutations = [
        ("request_id", 5),
        ("request_id", None),
        ("prompt", 3),
        ("prompt_token_ids", "abc"),
        ("prompt_token_ids", [-1]),
        ("prompt_token_ids", [10**12]),
        ("params", []),
        ("params", {"max_tokens": -3}),
        ("params", {"n": "two"}),
        ("params", {"temperature": -1}),
        ("params", {"max_tokens": 10**9}),
        ("params", {"bogus": 1}),
        ("params", {"logprobs": 99}),
        ("stream", "yes"),
        ("type", "launch"),
        ("type", 7),
        ("extra", 1),
        ("params", {"max_tokens": 2**63}),
        ("params", {"stop": 5}),
        ("params", {"seed": 1.5}),
        ("params", {"max_tokens": 2**64 - 1}),
        ("params", {"top_p": 1e308}),
        ("params", {"n": 65}),  # over --max-n
        ("params", {"stop": [f"s{i}" for i in range(17)]}),  # over --max-stop-strings
        ("params", {"beam_width": 11}),
    ]
    for key, value in mutations:
        frames.append([enc({**valid, key: value})])
    frames += [
        [enc({k: v for k, v in valid.items() if k != "request_id"})],
        [enc({k: v for k, v in valid.items() if k != "type"})],
        [enc({**valid, "prompt": None})],  # neither prompt nor ids
        [enc({**valid, "prompt_token_ids": [1, 2]})],  # both
        [enc({**valid, "prompt": "x " * 2000})],  # over max_model_len
        [enc({**valid, "prompt_token_ids": []})],
        [b""],
        [b"\xc1"],
        [b"\x81\xa4type\xa8generat\xff"],  # invalid utf-8 inside a string
        [enc(valid), enc(valid)],  # two frames
        [enc([1, 2, 3])],
        [enc("generate")],
        [enc(None)],
    ]
    while len(frames) < 100:
        frames.append([bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))])
    return frames


def _string_request_id(frames: list[bytes]) -> str | None:
    try:
        obj = msgspec.msgpack.decode(frames[0]) if len(frames) == 1 else None
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def test_200_malformed_inputs_get_clear_errors_and_the_server_keeps_serving(server, model):
    rng = random.Random(11)
    zc = ZmqClient(server.zmq_endpoint, timeout_s=20)
    # a request in flight throughout must finish untouched
    survivor = zc.stream(prompt_token_ids=[5, 6, 7], max_tokens=60, temperature=0.0, ignore_eos=True)
    first = next(survivor)

    for body in _fuzz_bodies(rng, model):
        req = urllib.request.Request(
            server.url + "/v1/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=20)
            raise AssertionError(f"accepted a malformed body: {body[-120:]!r}")
        except urllib.error.HTTPError as e:
            assert 400 <= e.code < 500, (e.code, body[:80])
            error = json.loads(e.read())["error"]
            assert error["message"] and error["type"], body[:80]
            if e.code == 400 and body.startswith(b'{"model"'):
                assert error["param"], (error, body[:80])

    for frames in _fuzz_frames(rng):
        zc.send_raw(*frames)
        reply = zc.receive_any()
        while not isinstance(reply, Error):  # the survivor's deltas interleave
            assert reply.request_id == first.request_id, reply
            zc._inbox[reply.request_id].append(reply)
            reply = zc.receive_any()
        assert 400 <= reply.code < 500 and reply.message, (frames, reply)
        # a readable map with a string request_id gets it back, whatever else is wrong
        assert reply.request_id == _string_request_id(frames), (frames, reply)

    rest = list(survivor)
    assert isinstance(rest[-1], Final) and rest[-1].completions[0].finish_reason == "length"
    assert len(rest[-1].completions[0].token_ids) == 60
    assert zc.generate(prompt="hello", max_tokens=3).usage.completion_tokens == 3
    assert client(server).completions.create(model=model, prompt="hello", max_tokens=3).usage.completion_tokens == 3
    zc.close()


NUMERIC_FIELDS = [
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "length_penalty",
    "truncate_prompt_tokens",
]  # fmt: skip
# JSON number texts (1e999 is how JSON says infinity; NaN is not JSON at all)
EXTREME_NUMBERS = ["1e999", "-1e999", "NaN", "18446744073709551616", "-99999999999999999999999", "1e-320", "-0.0"]
BEAM_EXTREMES = [
    {"best_of": 1}, {"best_of": 10}, {"best_of": 11}, {"best_of": 64}, {"best_of": 65}, {"best_of": 0},
    {"best_of": 3, "n": 3}, {"best_of": 2, "n": 3}, {"best_of": 3, "length_penalty": 5.0},
    {"best_of": 3, "length_penalty": -5.0}, {"best_of": 3, "length_penalty": 5.0001}, {"best_of": 3, "max_tokens": 500},
    {"best_of": 3, "length_penalty": 1e308}, {"best_of": 3, "stream": True}, {"best_of": 3, "max_tokens": 0},
]  # fmt: skip


def _extreme_bodies(model: str) -> list[tuple[str, bytes]]:
    """(path, body): every numeric field at every extreme, beam searches at theirs, nesting bombs
    and invalid UTF-8."""
    head = f'{{"model": {json.dumps(model)}, "prompt": "hi", "max_tokens": 2'
    out = []
    for field in NUMERIC_FIELDS:
        for number in EXTREME_NUMBERS:
            out.append(("/v1/completions", f'{head}, "{field}": {number}}}'.encode()))
    for number in EXTREME_NUMBERS:
        out.append(("/v1/completions", f'{head}, "stop_token_ids": [{number}]}}'.encode()))
        out.append(("/v1/completions", f'{{"prompt": [5, {number}], "max_tokens": 2}}'.encode()))
        out.append(("/v1/chat/completions", f'{{"messages": [], "top_logprobs": {number}, "logprobs": true}}'.encode()))
    for extra in BEAM_EXTREMES:
        out.append(
            (
                "/v1/completions",
                json.dumps({"prompt": "hi", "max_tokens": 3, "use_beam_search": True, **extra}).encode(),
            )
        )
    for number in EXTREME_NUMBERS:
        out.append(("/detokenize", f'{{"tokens": [5, {number}]}}'.encode()))
    hi = b'[{"role": "user", "content": "hi"}]'
    call = b'{"id": "x", "function": {"name": "f", "arguments": "{"}}'
    chat = "/v1/chat/completions"
    out += [  # the agents' surface: tokenize, detokenize, tools, template variables
        ("/tokenize", b"{}"),
        ("/tokenize", b'{"prompt": "hi", "messages": ' + hi + b"}"),
        ("/tokenize", b'{"messages": ' + hi + b', "chat_template_kwargs": {"tokenize": true}}'),
        ("/tokenize", b'{"messages": ' + hi + b', "chat_template_kwargs": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}"),
        ("/detokenize", b'{"tokens": "abc"}'),
        ("/v1/embeddings", b'{"input": "hi"}'),  # a generating engine computes no embeddings
        ("/v1/embeddings", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("/v1/embeddings", b'{"input": [[1, -5]], "dimensions": -1, "encoding_format": "x"}'),
        ("/invocations", b'{"input": ["a", "b"], "dimensions": 99999}'),
        ("/v1/responses", b'{"input": "hi", "max_output_tokens": 2, "store": true}'),
        ("/v1/responses", b'{"input": [{"type": "function_call"}], "max_output_tokens": 2}'),
        ("/v1/responses", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("/v1/responses", b'{"input": [{"role": "user", "content": [{"type": "input_image"}]}]}'),
        ("/v1/responses", b'{"input": "hi", "tools": [{"type": "function"}], "max_output_tokens": 2}'),
        ("/v1/responses", b'{"input": "hi", "text": {"format": {"type": "json_schema"}}, "max_output_tokens": 2}'),
        ("/v1/responses", b'{"input": "hi", "tool_choice": {"type": "function"}, "max_output_tokens": 2}'),
        ("/detokenize", b'{"tokens": [' + b"1," * 100_000 + b"1]}"),
        (chat, b'{"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}, ' + hi[1:] + b"}"),
        (chat, b'{"messages": [{"role": "assistant", "tool_calls": [' + call + b"]}, " + hi[1:] + b"}"),
        (chat, b'{"messages": ' + hi + b', "tools": [{"function": {"name": "f"}}], "tool_choice": 1}'),
        (chat, b'{"messages": ' + hi + b', "chat_template_kwargs": {"conversation": []}}'),
        (chat, b'{"messages": ' + hi + b', "include_reasoning": "maybe", "max_tokens": 1}'),
    ]  # fmt: skip
    bomb = b"[" * 50_000 + b"]" * 50_000
    out += [
        ("/v1/completions", b'{"prompt": ' + bomb + b"}"),
        ("/v1/completions", b'{"prompt": "hi", "x": ' + bomb + b"}"),
        ("/v1/completions", b'{"prompt": "hi", "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
        ("/v1/chat/completions", b'{"messages": ' + bomb + b"}"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "z": ' + bomb + b"}]}"),
        ("/v1/completions", b'{"prompt": "hi", "\xff": 1}'),
        ("/v1/completions", b'{"pro\xc3mpt": "hi"}'),
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}'),  # a UTF-8 encoded surrogate
        ("/v1/chat/completions", b'{"messages": [{"role": "\xff", "content": "hi"}]}'),
    ]  # fmt: skip
    return out


def _extreme_frames() -> list[bytes]:
    enc = msgspec.msgpack.encode
    base = {"type": "generate", "request_id": "x", "prompt": "hi", "stream": False}
    frames = []
    numbers = [float("inf"), float("-inf"), float("nan"), 2**64 - 1, -(2**63), 1e-320, -0.0, 10**18]
    for field in NUMERIC_FIELDS + ["beam_width", "priority"]:
        for number in numbers:
            frames.append(enc({**base, "params": {"max_tokens": 2, field: number}}))
    for width in (0, 1, 10, 11, 65, 2**63 - 1):
        for penalty in (5.0, -5.0, 5.5, float("inf"), 1e308):
            frames.append(enc({**base, "params": {"max_tokens": 3, "beam_width": width, "length_penalty": penalty}}))
    frames += [
        b"\x91" * 5000 + b"\xc0",
        b"\x81\xa1a" * 5000 + b"\xc0",
        b"\x84\xa4type\xa8generate\xaarequest_id\xa1x\xa6prompt\xa2hi\xa6params" + b"\x81\xa1a" * 5000 + b"\xc0",
        enc({**base, "prompt_token_ids": [5, 2**63 - 1], "prompt": None}),
        b"\x83\xa4type\xa8generate\xaarequest_id\xa1x\xa6prompt\xa2\xff\xfe",  # invalid UTF-8 in a string
        b"\x83\xa4type\xa8generate\xaarequest_id\xa1x\xa2\xff\xfe\xa2hi",  # ... and in a key
    ]  # fmt: skip
    return frames


def test_extremes_and_bombs_never_break_either_surface(server, model):
    """Each input gets a 4xx naming the problem (or is served, where it is valid); after each,
    /health answers 200 and a request is served on both surfaces."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

    def http(method, path, body=None):
        conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, r.read()

    zc = ZmqClient(server.zmq_endpoint, timeout_s=30)
    normal = json.dumps({"model": model, "prompt": "ok", "max_tokens": 1}).encode()

    def check_serving(what):
        assert http("GET", "/health")[0] == 200, f"unhealthy after {what!r}"
        status, body = http("POST", "/v1/completions", normal)
        assert status == 200, (what, body)
        assert zc.generate(prompt="ok", max_tokens=1).usage.completion_tokens == 1, what

    for path, body in _extreme_bodies(model):
        status, reply = http("POST", path, body)
        what = body[:100]
        assert status == 200 or 400 <= status < 500, (status, what, reply[:300])
        if status != 200:
            error = json.loads(reply)["error"]
            assert error["message"] and "Traceback" not in error["message"], (what, error)
            assert error["param"], (what, error)
        check_serving(what)
    for frame in _extreme_frames():
        zc.send_raw(frame)
        reply = zc.receive_any()
        assert isinstance(reply, Final) or (isinstance(reply, Error) and 400 <= reply.code < 500), (frame[:80], reply)
        if isinstance(reply, Error):
            assert "Traceback" not in reply.message
        check_serving(frame[:80])
    zc.close()
    conn.close()


def test_a_client_that_leaves_before_a_non_streamed_answer_has_its_request_aborted(server, model):
    aborts = server.metrics().get("pagedllm:request_success_total{finished_reason=abort}", 0)
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert wait_until(lambda: server.metrics()["pagedllm:num_requests_running"] == 1, timeout_s=10, interval=0.1)
    # the connection is closed mid-generation
    assert wait_until(lambda: server.metrics()["pagedllm:num_requests_running"] == 0, timeout_s=20, interval=0.1)
    after = server.metrics()
    assert after["pagedllm:request_success_total{finished_reason=abort}"] == aborts + 1
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0


def test_zmq_errors_name_the_field_and_ids_are_per_client(server):
    with ZmqClient(server.zmq_endpoint) as a, ZmqClient(server.zmq_endpoint) as b:
        with pytest.raises(ZmqRequestError) as err:
            a.generate(prompt="hi", max_tokens=-2)
        assert err.value.code == 400 and err.value.field == "params.max_tokens"
        with pytest.raises(ZmqRequestError) as err:
            a.generate(prompt="hi", max_tokens=10**6)
        assert err.value.field == "params.max_tokens" and "maximum context length" in str(err.value)
        with pytest.raises(ZmqRequestError) as err:  # --max-n is capped by --max-num-seqs (64)
            a.generate(prompt="hi", max_tokens=2, n=65)
        assert err.value.code == 400 and err.value.field == "params.n" and "<= 64" in str(err.value)
        for frame, field in (
            ({"type": "generate", "request_id": "x1", "prompt": "hi", "colour": 1}, "colour"),
            ({"type": "generate", "request_id": "x2", "prompt": "hi", "stream": "yes"}, "stream"),
            ({"type": "generate", "request_id": "x3", "prompt": 5}, "prompt"),
        ):
            a.send_raw(msgspec.msgpack.encode(frame))
            reply = a.receive_any()
            assert (reply.request_id, reply.code, reply.field) == (frame["request_id"], 400, field), reply
        # the same id from two clients is two requests
        sa = a.stream(prompt="one", request_id="same", max_tokens=3, temperature=0.0)
        sb = b.stream(prompt="two", request_id="same", max_tokens=5, temperature=0.0)
        assert list(sa)[-1].usage.completion_tokens == 3 and list(sb)[-1].usage.completion_tokens == 5


def test_zmq_ready_message_and_a_duplicate_id_refuses_only_the_duplicate(server):
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc:
        ready = zc.wait_ready()
        assert ready.max_model_len == MAX_MODEL_LEN and ready.model
        # long enough that it is still running when the duplicate arrives, on a loaded machine too
        # (at 40 tokens, with a busy process beside two test workers, it had ended first)
        running = zc.stream(
            prompt_token_ids=[5, 6, 7], request_id="dup", max_tokens=400, temperature=0.0, ignore_eos=True
        )
        next(running)
        again = {"type": "generate", "request_id": "dup", "prompt": "again", "params": {"max_tokens": 3}}
        zc.send_raw(msgspec.msgpack.encode(again))
        reply = zc.receive_any()
        while not isinstance(reply, Error):  # the running request's deltas, kept for it
            zc._inbox[reply.request_id].append(reply)
            reply = zc.receive_any()
        assert (reply.code, reply.request_id, reply.field) == (409, "dup", "request_id")
        final = list(running)[-1]
        assert isinstance(final, Final) and final.completions[0].finish_reason == "length"
        assert len(final.completions[0].token_ids) == 400


def test_zmq_logprobs_k_returns_the_k_most_likely_of_each_token(server):
    with ZmqClient(server.zmq_endpoint, timeout_s=20) as zc:
        deltas = [
            m
            for m in zc.stream(prompt_token_ids=[5, 6, 7], max_tokens=4, temperature=0.0, logprobs=3)
            if not isinstance(m, Final)
        ]
    assert deltas
    for delta in deltas:
        for token, lp, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs):
            assert len(top) == 3 and top[0][0] == token  # greedy: the most likely
            assert top[0][1] == pytest.approx(lp) and top[0][1] >= top[1][1] >= top[2][1]


def test_each_limit_at_its_bound_and_just_past_it(model):
    """Bounds on one request: the value at the bound is served, one past it is a clear 400
    (413 for size) naming the field, over HTTP and ZMQ; the server keeps serving."""
    srv = ServerProcess(
        model,
        "--num-kv-blocks",
        "128",
        "--max-request-bytes",
        "2000",
        "--max-prompts",
        "3",
        "--max-n",
        "4",
        "--max-logprobs",
        "5",
        "--max-stop-strings",
        "2",
    )
    http = client(srv)
    try:

        def fails(status, param, **body):
            with pytest.raises(openai.APIStatusError) as err:
                http.completions.create(model=model, max_tokens=1, **body)
            assert err.value.status_code == status and err.value.body.get("param") == param, err.value.body

        ok = lambda **body: http.completions.create(model=model, max_tokens=1, **body)
        assert len(ok(prompt=["a", "b", "c"]).choices) == 3
        fails(400, "prompt", prompt=["a", "b", "c", "d"])
        assert len(ok(prompt="a", n=4).choices) == 4
        fails(400, "n", prompt="a", n=5)
        ok(prompt="a", extra_body={"use_beam_search": True, "best_of": 4})
        fails(400, "best_of", prompt="a", extra_body={"use_beam_search": True, "best_of": 5})
        ok(prompt="a", logprobs=5)
        fails(400, "logprobs", prompt="a", logprobs=6)
        ok(prompt="a", stop=["x", "y"])
        fails(400, "stop", prompt="a", stop=["x", "y", "z"])
        with pytest.raises(openai.APIStatusError) as err:
            http.chat.completions.create(
                model=model, max_tokens=1, messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=6
            )
        assert err.value.status_code == 400 and err.value.body.get("param") == "top_logprobs"
        base = {"model": model, "prompt": "a", "max_tokens": 1, "user": ""}
        pad = 2000 - len(json.dumps(base))
        for size, status in ((2000, 200), (2001, 413)):
            body = json.dumps({**base, "user": "u" * (pad + size - 2000)}).encode()
            assert len(body) == size
            req = urllib.request.Request(
                srv.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                code = urllib.request.urlopen(req, timeout=20).status
            except urllib.error.HTTPError as e:
                code = e.code
            assert code == status, (size, code)

        with ZmqClient(srv.zmq_endpoint, timeout_s=20) as zc:
            for field, at, past in (
                ("n", 4, 5),
                ("beam_width", 4, 5),
                ("logprobs", 5, 6),
                ("stop", ["x", "y"], ["x", "y", "z"]),
            ):
                assert zc.generate(prompt="a", max_tokens=1, **{field: at}).usage.completion_tokens >= 1
                with pytest.raises(ZmqRequestError) as err:
                    zc.generate(prompt="a", max_tokens=1, **{field: past})
                assert (err.value.code, err.value.field) == (400, f"params.{field}"), err.value
            with pytest.raises(ZmqRequestError) as err:  # within the limits, but refused by the engine core
                zc.generate(prompt="a", max_tokens=1000, beam_width=4)
            assert (err.value.code, err.value.field) == (400, "params.beam_width") and "KV" in str(err.value)

            def frame_of(size: int) -> bytes:  # two long stop strings, then prompt tokens of one byte each
                def frame(num_tokens: int) -> bytes:
                    params = {"max_tokens": 1, "stop": ["x" * 900, "y" * 900]}
                    body = {"type": "generate", "request_id": "big", "prompt_token_ids": [5] * num_tokens}
                    return msgspec.msgpack.encode({**body, "params": params})

                return frame(100 + size - len(frame(100)))

            for size, code in ((2000, None), (2001, 413)):
                raw = frame_of(size)
                assert len(raw) == size
                zc.send_raw(raw)
                reply = zc.receive_any()
                assert (reply.code if isinstance(reply, Error) else None) == code, reply
                while not isinstance(reply, (Final, Error)):
                    reply = zc.receive_any()
        assert ok(prompt="still serving").choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_metrics_parse_and_move(server, model):
    before = server.settled_metrics()
    client(server).completions.create(model=model, prompt="count me", max_tokens=5, temperature=0)
    after = server.settled_metrics()
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == 5
    assert after["pagedllm:prompt_tokens_total"] > before["pagedllm:prompt_tokens_total"]
    assert (
        after["pagedllm:request_success_total{finished_reason=length}"]
        == before.get("pagedllm:request_success_total{finished_reason=length}", 0) + 1
    )
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"pagedllm:{name}_count"] == before[f"pagedllm:{name}_count"] + 1, name
    assert (
        after["pagedllm:inter_token_latency_seconds_count"] - before["pagedllm:inter_token_latency_seconds_count"] == 4
    )
    assert after["pagedllm:batch_size_count"] > before["pagedllm:batch_size_count"]
    # one step per token; each but the first planned while the one before computed
    assert after["pagedllm:engine_steps_total"] - before["pagedllm:engine_steps_total"] == 5
    assert after["pagedllm:steps_planned_ahead_total"] - before["pagedllm:steps_planned_ahead_total"] == 4
    assert 0 <= after["pagedllm:steps_in_decode_runs_total"] - before["pagedllm:steps_in_decode_runs_total"] <= 3
    assert after["pagedllm:prefix_cache_queries_total"] > before["pagedllm:prefix_cache_queries_total"]
    assert "pagedllm:num_preemptions_total" in after and "pagedllm:num_requests_swapped" in after
    info = "block_size=16,cache_dtype=int8,num_gpu_blocks=400,num_swap_blocks=0"
    assert after[f"pagedllm:cache_config_info{{{info}}}"] == 1  # the served engine's 8-bit cache
    assert server.get("/health")[0] == 200
    # the gauges routers read (the Gateway API inference extension's), under vLLM's names too
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    stream = client(server).completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    assert wait_until(lambda: server.metrics()["vllm:num_requests_running"] == 1, timeout_s=10, interval=0.05)
    during = server.metrics()
    assert during["vllm:kv_cache_usage_perc"] > 0
    stream.close()
    settled = server.settled_metrics()
    assert (
        all(settled[f"vllm:{n}"] == settled[f"pagedllm:{n}"] for n in names)
        and settled["vllm:num_requests_running"] == 0
    )


def test_api_key_unknown_model_and_a_full_queue(model):
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--api-key", "sesame", "--max-queue-len", "0")
    try:
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=srv.url + "/v1", api_key="sesame", max_retries=0)
        assert right.models.list().data[0].id == model
        with pytest.raises(openai.NotFoundError) as err:
            right.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
        with pytest.raises(openai.InternalServerError) as err:  # 503: no room in the queue
            right.completions.create(model=model, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert srv.get("/health")[0] == 200 and srv.get("/metrics")[0] == 200  # no key needed
    finally:
        srv.stop()
