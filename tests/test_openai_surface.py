"""The OpenAI surface as clients written for vLLM's server use it, through the real openai client
and raw HTTP: logit_bias (against transformers' logits plus the bias), --max-logprobs and the
logprobs forms vLLM accepts (-1 for the whole vocabulary, "true" as a string, token_id:N names,
chat echo of a continued message), server-load tracking (GET /load), SageMaker's /invocations,
usage forced onto every streamed chunk, and the keys vLLM's bodies carry as null.

The server runs the demo model in float32 (so that transformers in float32 is its oracle) with
--max-logprobs above its vocabulary."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.entrypoints.default_model import shipped_model_dir

from serve_helpers import ServerProcess, client, post

DEMO_VOCAB = 4096


@pytest.fixture(scope="module")
def server():
    flags = ["--max-model-len", "512", "--dtype", "float32", "--max-logprobs", "5000", "--zmq-endpoint", "none"]
    srv = ServerProcess("", *flags, "--enable-server-load-tracking", "--enable-force-include-usage")
    yield srv
    srv.stop()


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
    status, error = post(server, "/invocations", {"neither": "x"})
    assert status == 400 and "messages" in error["error"]["message"]
    status, error = post(server, "/invocations", {"input": "an embedding"})  # this engine generates
    assert status == 400 and error["error"]["param"] == "model" and "--runner pooling" in error["error"]["message"]
    status, error = post(server, "/invocations", {"messages": [], "max_tokens": "x"})
    assert status == 400 and error["error"]["param"] == "max_tokens"
    status, error = post(server, "/invocations", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and error["error"]["param"].startswith("prompt"), error  # a nesting bomb: no 500


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
    chunks = list(  # greedy, past EOS: five tokens whatever the sampler would draw
        c.completions.create(
            model=model, prompt="A list", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert all(ch.usage is not None and ch.usage.completion_tokens > 0 for ch in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5


def hf_biased_greedy(prompt: list[int], bias: dict[int, float], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens on logits + bias, and each step's log-probabilities."""
    hf = AutoModelForCausalLM.from_pretrained(shipped_model_dir(), dtype=torch.float32).eval()
    add = torch.zeros(DEMO_VOCAB)
    for token, value in bias.items():
        add[token] = value
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float() + add, dim=-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(lp)
            ids.append(tokens[-1])
    return tokens, logprobs


def test_logit_bias_is_transformers_logits_plus_the_bias(server):
    """Greedy tokens and logprobs (the sampled token's and the top 5) of a biased request equal
    transformers' on logits + bias: the unbiased first choice banned (-100), another token
    boosted, a third nudged; through completions and chat alike."""
    c = client(server)
    model = c.models.list().data[0].id
    prompt = [93, 4, 275, 451, 718, 320]
    plain = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    first = (
        plain.choices[0].model_extra.get("token_ids")
        or c.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    bias = {first[0]: -100.0, 1500: 6.5, 201: 2.25}
    want, want_lps = hf_biased_greedy(prompt, bias, 6)
    assert want[0] != first[0]
    out = c.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    assert out.model_extra["token_ids"] == want
    for p, (token, lp) in enumerate(zip(want, want_lps)):
        assert out.logprobs.token_logprobs[p] == pytest.approx(float(lp[token]), abs=2e-4)
        top = {int(name.split(":")[1]): value for name, value in out.logprobs.top_logprobs[p].items()}
        for t in lp.topk(5).indices.tolist():
            assert top[t] == pytest.approx(float(lp[t]), abs=2e-4), (p, t)
    chat_prompt = [{"role": "user", "content": "A list is"}]
    chat = c.chat.completions.create(
        model=model,
        messages=chat_prompt,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    rendered = c.completions.create(
        model=model,
        prompt="<|user|>\nA list is</s>\n<|assistant|>\n",
        max_tokens=4,
        temperature=0,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert chat.choices[0].token_ids == rendered.choices[0].model_extra["token_ids"]
    assert first[0] not in chat.choices[0].token_ids


@pytest.mark.parametrize(
    "bias,why",
    [
        ({"x": 1}, "token ids"),
        ({"1.5": 1}, "token ids"),
        ({"-3": 1}, "token ids"),
        ({str(DEMO_VOCAB): 1}, "out of vocabulary"),
        ({"99999999999999999999": 1}, "token ids"),
        ({"5": 100.5}, "[-100, 100]"),
        ({"5": -1e308}, "[-100, 100]"),
        ({"5": "x"}, None),
        ([5], None),
    ],
)
def test_a_bad_logit_bias_is_a_400_naming_it(server, bias, why):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        status, reply = post(server, path, {**body, "logit_bias": bias})
        assert status == 400 and reply["error"]["param"].startswith("logit_bias"), reply
        assert why is None or why in reply["error"]["message"], reply
    status, reply = post(server, "/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}')
    assert status == 400, reply


def test_logit_bias_over_the_whole_vocabulary_and_with_beams_n_and_a_grammar(server):
    """A bias on every token of the vocabulary; beams and n > 1 samples all biased; a
    constrained request whose grammar forbids the boosted token still follows its grammar."""
    c = client(server)
    model = c.models.list().data[0].id
    everything = {str(t): (-1.0 if t % 2 else 1.0) for t in range(DEMO_VOCAB)}
    out = c.completions.create(
        model=model,
        prompt="A list",
        max_tokens=8,
        temperature=0,
        logit_bias=everything,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert len(out.choices[0].model_extra["token_ids"]) == 8
    banned = {str(t): -100.0 for t in range(0, DEMO_VOCAB, 2)}  # every even token id
    beams = c.completions.create(
        model=model,
        prompt="A list",
        max_tokens=6,
        n=2,
        logit_bias=banned,
        extra_body={"use_beam_search": True, "return_token_ids": True, "ignore_eos": True},
    )
    samples = c.completions.create(
        model=model,
        prompt="A list",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=3,
        logit_bias=banned,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    for choice in beams.choices + samples.choices:
        assert all(t % 2 for t in choice.model_extra["token_ids"]), choice
    digits = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    letter_a = {"64": 100.0}  # "a"? whatever token 64 is, the grammar's mask comes after the bias
    structured = c.completions.create(
        model=model,
        prompt="JSON:",
        max_tokens=20,
        temperature=0,
        logit_bias=letter_a,
        extra_body={"structured_outputs": {"json": digits}},
    )
    assert isinstance(json.loads(structured.choices[0].text)["n"], int)


def test_max_logprobs_and_the_logprobs_forms_vllm_clients_send(server):
    """--max-logprobs 5000 (above the 4,096-token vocabulary): -1 asks for the whole vocabulary,
    in top_logprobs and prompt_logprobs; "logprobs": "true" as a string; return_tokens_as_token_ids."""
    c = client(server)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": "Beijing is the capital of which country?"}]
    status, body = post(
        server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "logprobs": "true", "top_logprobs": -1}
    )
    assert status == 200, body
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == DEMO_VOCAB
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": -1})
    assert all(entry is None or len(entry) >= DEMO_VOCAB for entry in chat.prompt_logprobs)
    ids = c.completions.create(
        model=model,
        prompt="A list",
        max_tokens=3,
        logprobs=2,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = ids.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice.logprobs.top_logprobs)
    chat = c.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert all(item.token.startswith("token_id:") for item in chat.choices[0].logprobs.content)
    status, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": "3", "temperature": "0"})
    assert status == 200 and body["usage"]["completion_tokens"] == 3  # as vLLM's pydantic models coerce


def test_chat_echo_continues_the_final_message(server):
    """echo with continue_final_message: the answer starts with the assistant message it continues
    (streamed: in a chunk before the new text); without echo, only the new text."""
    c = client(server)
    model = c.models.list().data[0].id
    saying = "A dictionary is"
    messages = [{"role": "user", "content": "tell me something"}, {"role": "assistant", "content": saying}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    echoed = c.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, extra_body={**extra, "echo": True}
    )
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, extra_body=extra)
    assert echoed.choices[0].message.content == saying + plain.choices[0].message.content
    assert not plain.choices[0].message.content.startswith(saying)
    rendered = c.completions.create(
        model=model,
        prompt=f"<|user|>\ntell me something</s>\n<|assistant|>\n{saying}",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert plain.choices[0].message.content == rendered.choices[0].text  # the message was left open
    stream = c.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, stream=True, extra_body={**extra, "echo": True}
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == echoed.choices[0].message.content
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message"


def test_token_id_keys_are_null_when_not_asked_for(server):
    status, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["prompt_token_ids"] is None and body["choices"][0]["token_ids"] is None
    status, body = post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert status == 200 and body["prompt_token_ids"] is None and body["choices"][0]["token_ids"] is None
