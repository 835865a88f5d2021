"""What agents send today, through the real `openai` client: automatic tool calls read from
each parser's format (hermes, llama3_json, mistral), reasoning split from the answer (qwen3,
deepseek_r1), whole and streamed, and vLLM's /tokenize and /detokenize.

The model is a random tiny Qwen 3 whose tokenizer has `<think>` and `</think>` as tokens; what
it writes is made to be a format's text by a grammar (a `structured_outputs` choice) or, for
the thinking, by a bias on `</think>`: the parsers then read what the engine generated."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serve_helpers import ServerProcess, client, post

TEMPLATES = Path(__file__).parent / "chat_templates"
THINK, END_THINK = 400, 401  # the tokens added to the tokenizer
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]
# each format's text for the two calls, with the content before them where the format has it
TEXTS = {
    "hermes": (
        "Let me look.\n",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    ),
    "llama3_json": (
        None,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    ),
    "mistral": (
        "Checking.",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
    ),
}
SERVERS = {  # parser -> its flags
    "hermes": ["--chat-template", str(TEMPLATES / "hermes.jinja"), "--reasoning-parser", "qwen3"],
    "llama3_json": ["--chat-template", str(TEMPLATES / "llama3_json.jinja")],
    # without jump-forward, steps are planned ahead: the grammar's gate opens between a step
    # planned and its masks sent
    "mistral": [
        "--chat-template",
        str(TEMPLATES / "mistral.jinja"),
        "--reasoning-parser",
        "deepseek_r1",
        "--no-jump-forward",
    ],
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model("qwen3", model_vocab_size=402), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(path)
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, END_THINK]
    return str(path)


@pytest.fixture(scope="module")
def servers(model):
    """One server a parser, started side by side."""

    def start(name):
        flags = ["--enable-auto-tool-choice", "--tool-call-parser", name, *SERVERS[name], "--max-model-len", "1024"]
        return ServerProcess(model, *flags, "--zmq-endpoint", "none")

    with ThreadPoolExecutor(len(SERVERS)) as pool:
        started = dict(zip(SERVERS, pool.map(start, SERVERS)))
    yield started
    for server in started.values():
        server.stop()


def forced(text: str, **extra) -> dict:
    """A body whose output the grammar makes exactly `text`."""
    return {"structured_outputs": {"choice": [text]}, **extra}


def no_thinking(parser: str) -> dict:
    """What lets the grammar apply from the first token: the template closes the thinking
    (qwen3), or a bias makes `</think>` the first token (deepseek_r1 thinks from the start;
    the grammar then masks it out)."""
    if parser == "hermes":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if parser == "mistral":
        return {"logit_bias": {str(END_THINK): 100}}
    return {}


def streamed_message(stream) -> tuple[str | None, str | None, list, str]:
    """(reasoning, content, tool calls, finish_reason) reassembled from the chunks as the
    openai client's users do: calls by index, their arguments concatenated."""
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if getattr(delta, "reasoning", None):
            reasoning.append(delta.reasoning)
        if delta.content:
            content.append(delta.content)
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    listed = [calls[i] for i in sorted(calls)]
    return ("".join(reasoning) or None), ("".join(content) or None), listed, finish


@pytest.mark.parametrize("parser", list(SERVERS))
def test_automatic_tool_calls_are_read_from_each_format_whole_and_streamed(servers, model, parser):
    api = client(servers[parser])
    prefix, text = TEXTS[parser]
    args = dict(model=model, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=200, temperature=0)
    body = forced(text, **no_thinking(parser))

    whole = api.chat.completions.create(**args, extra_body=body)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == prefix
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == CALLS
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(ids)
    if parser == "mistral":  # its templates take nine alphanumeric characters
        assert all(len(i) == 9 and i.isalnum() for i in ids)

    reasoning, content, calls, finish = streamed_message(
        api.chat.completions.create(**args, stream=True, extra_body=body)
    )
    assert (content, finish) == (prefix, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert all(c["id"] for c in calls)
    if parser == "mistral":  # deepseek_r1 thought nothing before the calls
        assert (reasoning, getattr(choice.message, "reasoning", None)) == (None, "")

    one = api.chat.completions.create(**args, parallel_tool_calls=False, extra_body=body)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


def test_a_malformed_call_stays_text_and_tool_choice_none_reads_no_calls(servers, model):
    api = client(servers["hermes"])
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    args = dict(model=model, messages=QUESTION, tools=[WEATHER], max_tokens=200, temperature=0)
    body = forced(broken, **no_thinking("hermes"))
    whole = api.chat.completions.create(**args, extra_body=body).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (broken, None, "stop")
    _, content, calls, finish = streamed_message(api.chat.completions.create(**args, stream=True, extra_body=body))
    assert (content, calls, finish) == (broken, [], "stop")

    text = TEXTS["hermes"][1]
    plain = api.chat.completions.create(**args, tool_choice="none", extra_body=forced(text, **no_thinking("hermes")))
    assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == (text, None)


def test_the_template_gets_the_tools_and_the_calls_of_earlier_turns(servers, model):
    """/tokenize renders the chat as generation would: the tools described, an assistant's
    earlier call written back in the format (its arguments as an object), the tool's answer."""
    tokenizer_of = {}
    for parser in SERVERS:
        history = [
            *QUESTION,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "abcDEF123",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ]
        status, out = post(servers[parser], "/tokenize", {"messages": history, "tools": [WEATHER]})
        assert status == 200, out
        status, back = post(servers[parser], "/detokenize", {"tokens": out["tokens"]})
        assert status == 200, back
        tokenizer_of[parser] = back["prompt"]
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    hermes, llama, mistral = tokenizer_of["hermes"], tokenizer_of["llama3_json"], tokenizer_of["mistral"]
    assert '"description": "the weather in a city"' in hermes and "<tool_response>\nsunny\n</tool_response>" in hermes
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in hermes
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in llama
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in llama
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]' in mistral
    assert mistral.count("[AVAILABLE_TOOLS]") == 1 and '"call_id": "abcDEF123"' in mistral


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [4, 5]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("parser", ["hermes", "mistral"])  # qwen3 and deepseek_r1
def test_reasoning_is_split_from_the_answer_and_only_the_answer_is_constrained(servers, model, parser):
    """A bias makes the model close its thinking after a few free tokens; the schema then
    constrains what follows only. The split is exactly the tokens before and after `</think>`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    api = client(servers[parser])
    args = dict(model=model, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=40, temperature=0)
    args["logit_bias"] = {str(END_THINK): {"hermes": 5, "mistral": 4}[parser]}  # a few tokens of thinking
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    whole = api.chat.completions.create(**args, extra_body={**body, "return_token_ids": True}).choices[0]
    ids = whole.token_ids
    cut = ids.index(END_THINK)
    assert cut >= 1, "the bias closed the thinking at once: lower it"
    assert whole.message.reasoning == tok.decode(ids[:cut])
    assert whole.message.content == tok.decode(ids[cut + 1 :], skip_special_tokens=True)
    assert json.loads(whole.message.content)["answer"] in (4, 5)  # the grammar held after </think> only
    assert whole.finish_reason == "stop"

    reasoning, content, calls, finish = streamed_message(
        api.chat.completions.create(**args, stream=True, extra_body=body)
    )
    assert (reasoning, content, calls, finish) == (whole.message.reasoning, whole.message.content, [], "stop")

    hidden = api.chat.completions.create(**args, extra_body={**body, "include_reasoning": False}).choices[0]
    assert getattr(hidden.message, "reasoning", None) is None and hidden.message.content == whole.message.content


def test_qwen3_without_thinking_is_all_content_and_constrained_from_the_start(servers, model):
    api = client(servers["hermes"])
    body = {"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"json": SCHEMA}}
    out = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=40, temperature=0, extra_body=body
    ).choices[0]
    assert getattr(out.message, "reasoning", None) is None
    assert json.loads(out.message.content)["answer"] in (4, 5)


def test_tokenize_and_detokenize_round_trip_and_refuse_bad_input(servers, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    server = servers["llama3_json"]
    status, out = post(
        server, "/tokenize", {"model": model, "prompt": "The quick brown fox", "return_token_strs": True}
    )
    assert status == 200, out
    assert out["tokens"] == tok.encode("The quick brown fox") and out["token_strs"] == tok.convert_ids_to_tokens(
        out["tokens"]
    )
    assert post(server, "/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": "The quick brown fox"})
    status, chat = post(server, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})
    expected = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n" + QUESTION[0]["content"] + "<|eot_id|>"
    assert status == 200 and tok.decode(chat["tokens"]) == expected
    assert chat["token_strs"] is None
    bad = [
        ({"tokens": [1, 10**6]}, "/detokenize", "tokens"),
        ({"tokens": "abc"}, "/detokenize", "tokens"),
        ({"prompt": "a", "messages": QUESTION}, "/tokenize", "prompt"),
        ({}, "/tokenize", "prompt"),
        ({"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, "/tokenize", "chat_template_kwargs"),
        ({"prompt": "a", "model": "other"}, "/tokenize", "model"),
    ]
    for body, path, field in bad:
        status, err = post(server, path, body)
        assert 400 <= status < 500 and err["error"]["param"] == field, (body, status, err)


def test_auto_tool_choice_without_a_parser_is_refused_at_start():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--enable-auto-tool-choice", "--zmq-endpoint", "none"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in proc.stderr and "Traceback" not in proc.stderr


# --- the Responses API ------------------------------------------------------------------------
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSE_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": CITY}
]
CALL_SCHEMA = {  # a llama3_json call, as the model's whole answer
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": CITY},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


def test_responses_answer_as_the_chat_completion_they_ask_for(servers, model):
    api = client(servers["llama3_json"])
    whole = api.responses.create(
        model=model, input="2 + 2?", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    chat = api.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
        max_tokens=8,
        temperature=0,
    )
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [o.type for o in whole.output] == ["message"]
    assert whole.output_text == chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 8)

    events = list(
        api.responses.create(
            model=model, input="2 + 2?", instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [o.status for o in events[-1].response.output] == ["completed"]  # the message, done

    schema = {
        "type": "object",
        "properties": {"answer": {"enum": [4, 5]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    structured = api.responses.create(model=model, input="2 + 2?", text=fmt, max_output_tokens=40, temperature=0)
    assert structured.status == "completed" and json.loads(structured.output_text)["answer"] in (4, 5)


def test_responses_call_functions_whole_and_streamed(servers, model):
    api = client(servers["llama3_json"])
    fmt = {"format": {"type": "json_schema", "name": "call", "schema": CALL_SCHEMA}}
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "snow"},
        {"role": "user", "content": "And in Paris?"},
    ]
    args = dict(model=model, input=history, tools=RESPONSE_TOOLS, text=fmt, max_output_tokens=80, temperature=0)
    whole = api.responses.create(**args)  # tool_choice auto: the parser reads the call
    (call,) = whole.output
    assert (whole.status, call.type, call.name) == ("completed", "function_call", "get_weather")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo") and call.call_id
    events = list(api.responses.create(**args, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", "get_weather", call.arguments)]
    assert events[-1].type == "response.completed"

    named = api.responses.create(
        model=model,
        input="Weather?",
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    assert [o.type for o in named.output] == ["function_call"] and "city" in json.loads(named.output[0].arguments)


def test_responses_refuse_what_needs_storing_and_bad_items(servers, model):
    server = servers["llama3_json"]
    bad = [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": ""}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ]
    for body, field in bad:
        status, err = post(server, "/v1/responses", body)
        assert status == 400 and err["error"]["param"] == field, (body, status, err)


def test_each_of_n_choices_has_its_own_calls_whole_and_streamed(servers, model):
    api = client(servers["hermes"])
    prefix, text = TEXTS["hermes"]
    args = dict(model=model, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=200, temperature=0, n=2)
    body = forced(text, **no_thinking("hermes"))
    whole = api.chat.completions.create(**args, extra_body=body)
    for choice in whole.choices:
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert (got, choice.message.content, choice.finish_reason) == (CALLS, prefix, "tool_calls")
    calls: dict[int, dict[int, dict]] = {}
    for chunk in api.chat.completions.create(**args, stream=True, extra_body=body):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(choice.index, {}).setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    for index in (0, 1):
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls[index].items())] == CALLS
