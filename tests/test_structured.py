"""Structured outputs as clients use them: JSON schemas, regexes and choices through the real
openai client against `pagedllm serve` with the demo model, sampled hot with several seeds;
tool calls; bad constraints refused before the engine; and the engine's own guarantees —
greedy output under a constraint unchanged by preemption, tensor parallelism and a worker
killed mid-document."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import threading

import jsonschema
import openai
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.entrypoints.zmq_client import ZmqClient, ZmqRequestError

from proc_helpers import workers_of
from serve_helpers import ServerProcess, client

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SMALL = {"type": "integer", "minimum": -50, "maximum": 50}


def closed(properties: dict, required=None, **extra) -> dict:
    """An object of these properties and no others (a small model would otherwise go on
    inventing keys until max_tokens)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


# 22 schemas: nested objects, bounded arrays, enums, integer ranges, string patterns and
# lengths, anyOf / oneOf, $ref / $defs, const, nullable types, additionalProperties
SCHEMAS = [
    closed({"name": NAME}),
    closed({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    closed({"ok": {"type": "boolean"}}),
    closed({"color": {"enum": ["red", "green", "blue"]}}),
    closed({"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": SMALL}),
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2},
    closed({"tags": {"type": "array", "items": NAME, "maxItems": 3}}),
    closed({"point": closed({"x": SMALL, "y": SMALL})}),
    closed({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    closed({"id": {"anyOf": [SMALL, NAME]}}),
    {
        "$defs": {"item": closed({"n": SMALL})},
        **closed({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}}),
    },
    closed({"v": {"const": 7}}),
    closed({"s": {"type": "string", "maxLength": 3}}),
    closed({"p": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}}),
    closed({"note": {"type": ["string", "null"], "maxLength": 8}}),
    closed({"a": SMALL, "b": {"type": "boolean"}, "c": {"enum": [1, 2]}}),
    closed({"opt": NAME, "must": {"type": "boolean"}}, required=["must"]),
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    closed({"who": {"oneOf": [closed({"k": {"const": "x"}}), {"type": "null"}]}}),
    closed({"list": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}}),
]


@pytest.fixture(scope="module")
def demo_server():
    srv = ServerProcess("", "--max-model-len", "512", "--max-num-seqs", "64")
    yield srv
    srv.stop()


def test_hot_samples_of_every_schema_parse_and_validate(demo_server):
    c = client(demo_server)
    for i, schema in enumerate(SCHEMAS):
        out = c.chat.completions.create(
            model="pagedllm-demo",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=120,
            temperature=0.9,
            seed=i,
            n=3,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop", (i, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_json_object_streamed_or_not(demo_server, stream):
    c = client(demo_server)

    def complete(**extra):
        out = c.completions.create(
            model="pagedllm-demo", prompt="The answer:", max_tokens=40, temperature=0.8, stream=stream, **extra
        )
        if not stream:
            return [(ch.text, ch.finish_reason) for ch in out.choices]
        texts, reasons = {}, {}
        for chunk in out:
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
        return [(texts[i], reasons[i]) for i in sorted(texts)]

    pattern = r"[0-9]{3}-[a-z]{2,5}"
    for seed in (1, 2):
        for text, reason in complete(n=2, seed=seed, extra_body={"structured_outputs": {"regex": pattern}}):
            assert re.fullmatch(pattern, text) and reason == "stop", text
        choices = ["alpha", "beta", "gamma delta"]
        for text, reason in complete(n=2, seed=seed, extra_body={"structured_outputs": {"choice": choices}}):
            assert text in choices and reason == "stop", text
    chat = c.chat.completions.create(
        model="pagedllm-demo",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a free-form object may run past max_tokens; what there is follows the grammar
        assert text.startswith("{")


def test_tool_calls_follow_the_functions_schema(demo_server):
    c = client(demo_server)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": NAME, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "What is the weather?"}]
    ask = functools.partial(
        c.chat.completions.create, model="pagedllm-demo", messages=messages, temperature=0.8, tools=[weather, clock]
    )
    get_weather = {"type": "function", "function": {"name": "get_weather"}}
    named = ask(max_tokens=80, seed=3, tool_choice=get_weather)
    named_call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and named_call.function.name == "get_weather"
    arguments = json.loads(named_call.function.arguments)
    jsonschema.validate(arguments, weather["function"]["parameters"])
    required = ask(max_tokens=120, seed=4, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(call.function.name in ("get_weather", "get_time") for call in calls)
    for call in calls:
        json.loads(call.function.arguments)
    streamed = ask(max_tokens=80, seed=3, tool_choice=get_weather, stream=True)
    pieces = [ch.choices[0].delta.tool_calls for ch in streamed if ch.choices and ch.choices[0].delta.tool_calls]
    assert pieces[0][0].function.name == "get_weather"  # the same seed: the same call, in pieces
    assert json.loads("".join(p[0].function.arguments or "" for p in pieces)) == arguments


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "use_beam_search": True, "best_of": 2}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_serves_on(demo_server, body, param):
    c = client(demo_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="pagedllm-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=body
        )
    assert e.value.body["param"].startswith(param), e.value.body
    assert c.completions.create(model="pagedllm-demo", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_zmq_takes_the_same_object_and_names_a_bad_one(demo_server):
    with ZmqClient(demo_server.zmq_endpoint, timeout_s=30) as zc:
        final = zc.generate(prompt="Pick:", max_tokens=10, structured_outputs={"choice": ["left", "right"]})
        assert final.completions[0].text in ("left", "right")
        with pytest.raises(ZmqRequestError) as e:
            zc.generate(prompt="x", max_tokens=4, structured_outputs={"regex": "(unclosed"})
        assert e.value.code == 400 and e.value.field == "params.structured_outputs.regex"


# --- the engine's guarantees ----------------------------------------------------------------
SCHEMA = SCHEMAS[11]  # $defs and $ref, an array of objects


def constrained_tokens(llm, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5 + i, 6, 7, 8] * (2 + i % 6) for i in range(24)]


def test_greedy_constrained_output_is_unchanged_by_preemption_tp_and_a_worker_kill(tiny_model):
    model = tiny_model("llama")
    with LLM(model, num_kv_blocks=256, max_model_len=128) as llm:
        want = constrained_tokens(llm, PROMPTS)
        texts = [llm.get_tokenizer().decode(t) for t in want]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # a pool so small that requests are preempted mid-document (recompute), two ranks, and a
    # worker killed while they run: every token the same
    with LLM(model, num_kv_blocks=14, max_model_len=128, tensor_parallel_size=2, max_worker_restarts=2) as llm:
        assert constrained_tokens(llm, PROMPTS) == want
        assert llm.last_stats.scheduler.num_preemptions > 0
        victim = max(workers_of(llm.engine.pid, llm.engine.ready.launcher_pid))
        killer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))
        killer.start()
        # three times the prompts: one pass takes ~0.2 s on a quiet machine, so the kill would
        # race its end
        assert constrained_tokens(llm, PROMPTS * 3) == want * 3
        killed_during_the_run = not killer.is_alive() and llm.last_stats.worker_restarts == 1
        killer.join()
    assert killed_during_the_run, "the worker was meant to die mid-document"


def test_jump_forward_appends_forced_tokens_with_the_same_output(tmp_path):
    """A schema of long fixed keys: the grammar forces most tokens. Appended unsampled and
    computed in one chunk, they give the token-by-token output in fewer steps. Token by token,
    constrained steps are planned ahead (their masks follow the results of the step before;
    the requests end while a step planned for them is in flight); the same output."""
    keys = {f"measurement_field_{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(6)}
    schema = {"type": "object", "properties": keys, "required": list(keys), "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["Answer in JSON.", "The dictionary", "A list is"]
    runs = []
    for jump_forward in (False, True):
        with LLM(None, max_model_len=512, jump_forward=jump_forward) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(([o.outputs[0].token_ids for o in outs], llm.last_stats.steps, llm.last_stats.planned_ahead))
    (plain, plain_steps, planned_ahead), (jumped, jumped_steps, _) = runs
    assert planned_ahead > plain_steps // 2, (planned_ahead, plain_steps)
    assert jumped == plain
    assert jumped_steps * 2 < plain_steps, (jumped_steps, plain_steps)
