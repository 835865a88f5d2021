"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request is turned into the chat
completion it asks for (instructions, input items, function tools, `text.format`), runs as one,
and its text is answered as the API's output items — reasoning (a reasoning parser's), the
message, function calls — whole or as the API's streamed events. Nothing is stored, so
`store: true` and `previous_response_id` are refused, naming the field."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from pagedllm.core.errors import InvalidParameter

from .openai_protocol import ChatCompletionRequest, now
from .openai_structured import tool_calls


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (InvalidParameter naming the field)."""
        if self.store:
            raise InvalidParameter("store", "responses are not stored here: send store: false (or leave it out)")
        if self.previous_response_id is not None:
            raise InvalidParameter(
                "previous_response_id", "is not supported: responses are not stored; send the conversation as input"
            )
        body: dict[str, Any] = {"messages": self._messages(), "stream": self.stream}
        body["parallel_tool_calls"] = self.parallel_tool_calls
        for mine, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if getattr(self, mine) is not None:
                body[theirs] = getattr(self, mine)
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = _response_format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        try:
            return msgspec.convert(body, ResponsesChat, strict=False)
        except msgspec.ValidationError as e:
            raise InvalidParameter("input", str(e)) from None

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            if not self.input:
                raise InvalidParameter("input", "must not be empty")
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidParameter("input", "must be a non-empty string or list of items")
        for i, item in enumerate(self.input):
            messages.append(_message(item, f"input[{i}]"))
        return messages


class ResponsesChat(ChatCompletionRequest, kw_only=True):
    """A Responses request as a chat completion: its errors name the Responses fields."""

    def wire_field(self, field: str) -> str:
        name = super().wire_field(field)
        if name in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if name.startswith("response_format"):
            return "text.format"
        if name.startswith("messages"):
            return "input"
        return name


def _text_of(content, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidParameter(f"{field}.content[{j}]", f"only text parts are supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise InvalidParameter(f"{field}.content", "must be a string or a list of text parts")


def _message(item: dict, field: str) -> dict:
    """An input item as a chat message: a message, a function call the model made earlier, or
    its output."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidParameter(f"{field}.role", f"must be user, system, developer or assistant, got {role!r}")
        return {"role": role, "content": _text_of(item.get("content", ""), field)}
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise InvalidParameter(field, "a function_call needs name and call_id")
        call = {"name": item["name"], "arguments": str(item.get("arguments", "{}"))}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": item["call_id"], "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidParameter(field, "a function_call_output needs call_id")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output", ""), field)}
    raise InvalidParameter(f"{field}.type", f"must be message, function_call or function_call_output, got {kind!r}")


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise InvalidParameter(f"tools[{i}].type", f"only function tools are supported, got {tool.get('type')!r}")
    if not isinstance(tool.get("name"), str):
        raise InvalidParameter(f"tools[{i}].name", "is required")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidParameter("tool_choice", 'must be none, auto, required, or {"type": "function", "name"}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidParameter("text.format.type", f"must be text, json_object or json_schema, got {fmt.get('type')!r}")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesAnswers:
    """The answer to one Responses request, from its chat completion's one choice."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, parser, model: str, reasoning_end=None):
        self.req, self.chat, self.parser, self.model = req, chat, parser, model
        self.functions = chat.forced_functions  # tool_choice required or named: the text is calls
        self.reasoning_end = reasoning_end
        self.id, self.created = _item_id("resp"), now()

    # --- the output items ---------------------------------------------------------------------
    def _calls(self, parts: dict) -> list[dict]:
        """The function calls of a finished choice: read by the parser, or from a forced call's text."""
        calls = parts.get("tool_calls") or []
        if self.functions is not None:
            calls = tool_calls(parts.get("content") or "", self.functions, self.chat.tool_choice) or []
            if calls:
                parts["content"] = None
        return [
            {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
            for c in calls
        ]

    @staticmethod
    def _reasoning_item(text: str) -> dict:
        return {
            "type": "reasoning",
            "id": _item_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict:
        return {
            "type": "message",
            "id": _item_id("msg"),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def _response(self, output: list[dict], comp, out, status: str | None = None, thought: bool = False) -> dict:
        """The response object (out: the final RequestOutput, None while it runs; thought:
        whether its text began with reasoning)."""
        finish = comp.finish_reason if comp is not None else None
        if status is None:
            status = {"length": "incomplete", "abort": "cancelled"}.get(finish, "completed")
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None,
            "model": self.model,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "tools": self.req.tools or [],
            "tool_choice": self.req.tool_choice
            if self.req.tool_choice is not None
            else self.chat.tool_choice or "auto",
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "text": self.req.text or {"format": {"type": "text"}},
            "store": False,
            "metadata": self.req.metadata or {},
            "output": output,
            "usage": self._usage(comp, out, thought) if out is not None else None,
        }
        return body

    def _usage(self, comp, out, thought: bool) -> dict:
        ids = list(comp.token_ids)
        thinking = 0
        if thought and self.reasoning_end is not None:  # the tokens up to and with `</think>`
            thinking = ids.index(self.reasoning_end) + 1 if self.reasoning_end in ids else len(ids)
        prompt = len(out.prompt_token_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": len(ids),
            "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": prompt + len(ids),
        }

    def body(self, out) -> dict:
        comp = out.outputs[0]
        parts = self.parser().message(comp.text) if self.parser is not None else {"content": comp.text}
        calls = self._calls(parts)
        output = [self._reasoning_item(parts["reasoning"])] if parts.get("reasoning") is not None else []
        if parts.get("content") is not None or not calls:
            output.append(self._message_item(parts.get("content") or ""))
        return self._response(output + calls, comp, out, thought="reasoning" in parts)

    # --- streamed events --------------------------------------------------------------------------
    async def events(self, updates):
        """The API's events, each with its sequence_number: created, in_progress, each output
        item added, its deltas, done; completed (or incomplete) with the whole response."""
        seq = 0

        def event(kind: str, **fields) -> dict:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq - 1, **fields}

        yield event("response.created", response=self._response([], None, None, "in_progress"))
        yield event("response.in_progress", response=self._response([], None, None, "in_progress"))
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being streamed
        held = []  # a forced call's text, read once whole
        parser = self.parser() if self.parser is not None else None

        def close():
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item = open_item, None
            index, part = len(output), item["content"][0]
            output.append(item)
            where = dict(item_id=item["id"], output_index=index, content_index=0)
            if item["type"] == "reasoning":
                done = [event("response.reasoning_text.done", **where, text=part["text"])]
            else:
                item["status"] = "completed"
                done = [
                    event("response.output_text.done", **where, text=part["text"]),
                    event("response.content_part.done", **where, part=part),
                ]
            return [*done, event("response.output_item.done", output_index=index, item=item)]

        def open_item_for(kind: str) -> list[dict]:
            """The open item made a `kind` one ("reasoning" or "content": a message), closing
            another; the events that added it."""
            nonlocal open_item
            wanted = "reasoning" if kind == "reasoning" else "message"
            if open_item is not None and open_item["type"] == wanted:
                return []
            out = close()
            open_item = self._reasoning_item("") if kind == "reasoning" else self._message_item("", "in_progress")
            index = len(output)
            out.append(event("response.output_item.added", output_index=index, item={**open_item, "content": []}))
            if kind == "content":
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(
                    event(
                        "response.content_part.added",
                        item_id=open_item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            return out

        def piece(delta: dict, hold: bool = self.functions is not None):
            if "tool_calls" in delta:
                out = []
                for call in delta["tool_calls"]:
                    out += close() + self._call_events(event, output, call["id"], call["function"])
                return out
            kind = "reasoning" if "reasoning" in delta else "content"
            if kind == "content" and hold:
                held.append(delta["content"])
                return []
            out = open_item_for(kind)
            open_item["content"][0]["text"] += delta[kind]
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            out.append(
                event(name, item_id=open_item["id"], output_index=len(output), content_index=0, delta=delta[kind])
            )
            return out

        last = None
        async for _, update in updates:
            last = update
            deltas = parser.feed(update.delta_text) if parser is not None else [{"content": update.delta_text}]
            if update.finish_reason is not None and parser is not None:
                deltas += parser.finish()
            for delta in deltas:
                if delta.get("content") == "" or delta.get("reasoning") == "":
                    continue
                for e in piece(delta):
                    yield e
        for e in close():
            yield e
        if last is None:
            return
        comp = last.output.outputs[0]
        if held:  # a forced call: its text, read whole (text still, where it was cut short)
            text = "".join(held)
            calls = self._calls({"content": text}) if comp.finish_reason == "stop" else []
            events = []
            for c in calls:
                events += self._call_events(
                    event, output, c["call_id"], {"name": c["name"], "arguments": c["arguments"]}
                )
            if not calls:
                events = piece({"content": text}, hold=False) + close()
            for e in events:
                yield e
        if not output:  # an empty answer is still a message
            output.append(self._message_item(""))
        response = self._response(output, comp, last.output, thought=parser is not None and parser.thought)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        yield event(kind, response=response)

    def _call_events(self, event, output: list, call_id: str, function: dict) -> list[dict]:
        item = {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call_id,
            "name": function["name"],
            "arguments": function["arguments"],
            "status": "completed",
        }
        index = len(output)
        output.append(item)
        return [
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            ),
            event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            ),
            event("response.output_item.done", output_index=index, item=item),
        ]
