"""Structured outputs in the OpenAI API: `response_format` (json_object, json_schema), vLLM's
`structured_outputs` object, and tool calls forced by `tool_choice` ("required", or a named
function), each turned into one StructuredOutputsParams; and the tool calls read back out of
the constrained text. `tool_choice: "auto"` constrains nothing: the model writes its calls in its
own format, which the server's tool-call parser reads (entrypoints/tool_parsers.py); "none"
generates text with no calls read."""

from __future__ import annotations

import json
import uuid

import msgspec

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.sampling_params import StructuredOutputsParams


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


def constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsParams | None,
    tools: list[Tool] | None = None,
    tool_choice=None,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's constraint, the field it came from) — at most one source may give one."""
    found = []
    if response_format is not None and response_format.type != "text":
        found.append((from_response_format(response_format), "response_format"))
    if structured_outputs is not None:
        found.append((structured_outputs, "structured_outputs"))
    forced = forced_tools(tools, tool_choice)
    if forced is not None:
        found.append((tool_schema(forced, tool_choice), "tool_choice"))
    if len(found) > 1:
        names = " and ".join(source for _, source in found)
        raise InvalidParameter(found[1][1], f"give one constraint on the output, not {names}")
    return found[0] if found else (None, None)


def from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidParameter("response_format.json_schema.schema", "is required with type json_schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema)
    raise InvalidParameter("response_format.type", f"must be text, json_object or json_schema, got {fmt.type!r}")


def forced_tools(tools: list[Tool] | None, tool_choice) -> list[FunctionDef] | None:
    """The functions a call must be made to, or None when the output is free text."""
    if tool_choice is None or tool_choice == "none":
        return None
    if not tools:
        raise InvalidParameter("tool_choice", "needs tools")
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidParameter(f"tools[{i}].type", f"only function tools are supported, got {tool.type!r}")
    functions = [t.function for t in tools]
    if tool_choice == "required":
        return functions
    if tool_choice == "auto":
        return None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise InvalidParameter(
            "tool_choice", 'must be none, auto, required, or {"type": "function", "function": {"name"}}'
        )
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise InvalidParameter("tool_choice", f"names {name!r}, which is not among the tools")
    return chosen


def tool_schema(functions: list[FunctionDef], tool_choice) -> StructuredOutputsParams:
    """A named function: its arguments object. "required": an array of one or more calls,
    each {"name": ..., "parameters": {...}} (as vLLM asks for them)."""
    if tool_choice != "required":
        return StructuredOutputsParams(json=functions[0].parameters or {"type": "object"})
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "parameters": f.parameters or {"type": "object"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def tool_calls(text: str, functions: list[FunctionDef], tool_choice) -> list[dict] | None:
    """The tool calls the constrained text holds, as the OpenAI API returns them; None when the
    text is not a whole document (it was cut short)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if tool_choice == "required":
        pairs = [(call["name"], call["parameters"]) for call in value]
    else:
        pairs = [(functions[0].name, value)]
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for name, arguments in pairs
    ]
