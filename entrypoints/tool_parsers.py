"""Automatic tool calls (`tool_choice: "auto"`): each model family writes its calls in its own
text format, and a parser reads them back out as the OpenAI API's `tool_calls`, with vLLM's
parser names (`--tool-call-parser`):

- hermes (Qwen 2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, once
  per call; the text before the first call is content.
- llama3_json (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several calls separated by `;`. Text that does not start so is content.
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (tokenizers before v11),
  or `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later); the text before is content.

A call is read only when it is whole and well-formed: its JSON parses and names a function.
Where a call is malformed (or the output was cut short inside one), it and everything after it
stay content, as text: a model's bad call is the client's to see, never a server error.

Streaming holds back only what may be the start of a call: content goes out as it comes, each
call goes out whole (its id, name and arguments in one delta) as soon as it has closed, and what
is left at the end is content. A whole answer is read by streaming its whole text at once
(entrypoints/chat_output.py), so the deltas the `openai` client reassembles equal it.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid

from .detokenizer import held_back

_DECODER = json.JSONDecoder()


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _json_at(text: str, i: int):
    """(the JSON value at i, the index after it), or None where none is whole there."""
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _call(value, args_key: str | tuple[str, ...] = "arguments") -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None where it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = (args_key,) if isinstance(args_key, str) else args_key
    args = next((value[k] for k in keys if k in value), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        parsed = _json_at(args, 0)
        args = parsed[0] if parsed is not None and parsed[1] == len(args) else None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


class ToolCallFormat:
    """One family's format: where its calls start, and the calls a text holds from there."""

    name = ""
    marker = ""  # the text that starts the calls

    def calls_start(self, text: str) -> int | None:
        """Where the calls start in the text, or None if they do not (yet)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def held_back(self, text: str) -> int:
        """How many characters at the end of a text without calls may still begin them."""
        return held_back(text, self.marker)

    def surely_content(self, text: str) -> bool:
        """Whether a text without calls can no longer start any (its calls start only at the start)."""
        return False

    def past_marker(self, region: str, i: int) -> int | None:
        """Where the text after the marker that comes next from i (past space) begins, or None
        where no marker comes next."""
        j = _skip_space(region, i)
        return j + len(self.marker) if region.startswith(self.marker, j) else None

    def read(self, region: str, final: bool) -> tuple[list[tuple[str, str]], int]:
        """(the whole calls at the start of the region, where the rest begins). Not final: only
        calls that no later text can change."""
        raise NotImplementedError

    def new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


class HermesFormat(ToolCallFormat):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"

    def read(self, region, final):
        calls, i = [], 0
        while True:
            body_start = self.past_marker(region, i)
            if body_start is None:
                return calls, i
            end = region.find(self.close, body_start)
            body_end = end if end >= 0 else len(region)
            if end < 0 and not final:
                return calls, i  # still open
            parsed = _json_at(region, _skip_space(region, body_start))
            call = _call(parsed[0]) if parsed is not None else None
            if call is None or region[parsed[1] : body_end].strip():
                return calls, i
            calls.append(call)
            i = body_end + (len(self.close) if end >= 0 else 0)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def calls_start(self, text):
        i = _skip_space(text, 0)
        if text.startswith(self.marker, i) or text.startswith("{", i):
            return i
        return None

    def held_back(self, text):
        rest = text.lstrip()
        return len(text) if self.marker.startswith(rest) else 0  # all space, or a marker begun

    def surely_content(self, text):
        rest = text.lstrip()
        return bool(rest) and not rest.startswith("{") and not self.marker.startswith(rest[: len(self.marker)])

    def read(self, region, final):
        calls, i = [], 0
        start = len(self.marker) if region.startswith(self.marker) else 0
        j = _skip_space(region, start)
        while j < len(region) and region[j] == "{":
            parsed = _json_at(region, j)
            call = _call(parsed[0], ("parameters", "arguments")) if parsed is not None else None
            if call is None:
                return calls, i
            calls.append(call)
            i = parsed[1]
            j = _skip_space(region, i)
            if j < len(region) and region[j] == ";":
                j = _skip_space(region, j + 1)
        return calls, i


class MistralFormat(ToolCallFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args = "[ARGS]"
    _ALPHANUMERIC = string.ascii_letters + string.digits

    def read(self, region, final):
        calls, i = [], 0
        while True:
            j = self.past_marker(region, i)
            if j is None:
                return calls, i
            j = _skip_space(region, j)
            if region.startswith("[", j):  # a JSON array of calls
                parsed = _json_at(region, j)
                if parsed is None or not isinstance(parsed[0], list) or not parsed[0]:
                    return calls, i
                read = [_call(item) for item in parsed[0]]
                if None in read:
                    return calls, i
                calls += read
                i = parsed[1]
                continue
            k = region.find(self.args, j)  # name[ARGS]{...}
            if k < 0:
                return calls, i
            parsed = _json_at(region, _skip_space(region, k + len(self.args)))
            call = _call({"name": region[j:k].strip(), "arguments": parsed[0]}) if parsed is not None else None
            if call is None:
                return calls, i
            calls.append(call)
            i = parsed[1]

    def new_id(self) -> str:
        """Mistral's templates take only 9 alphanumeric characters as a call's id."""
        return "".join(secrets.choice(self._ALPHANUMERIC) for _ in range(9))


TOOL_CALL_FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
# their markers are special tokens in those families' tokenizers: the text must keep them
KEEPS_SPECIAL_TOKENS = ("llama3_json", "mistral")


def tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
    return TOOL_CALL_FORMATS[name]


def _as_tool_calls(fmt: ToolCallFormat, calls: list[tuple[str, str]]) -> list[dict]:
    return [{"id": fmt.new_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]


class StreamedToolCalls:
    """One choice's streamed text in, its deltas out: {"content": ...} and {"tool_calls": [...]}."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of content sent
        self.start: int | None = None  # where the calls start
        self.calls_sent = 0
        self.content_only = False  # llama3_json: the output surely holds no call

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        out = []
        if self.start is None:
            start = None if self.content_only else self.fmt.calls_start(self.text)
            if start is None:
                self.content_only = self.fmt.surely_content(self.text)
                end = len(self.text) - (0 if self.content_only else self.fmt.held_back(self.text))
                return self._content(end)
            out += self._content(start)
            self.start = start
        calls, _ = self.fmt.read(self.text[self.start :], final=False)
        return out + self._calls(calls)

    def finish(self) -> list[dict]:
        """The deltas of what was held back, read as the whole answer is."""
        if self.start is None:
            return self._content(len(self.text), final=True)
        calls, rest = self.fmt.read(self.text[self.start :], final=True)
        if not calls:  # no whole call: the marker and what follows are text
            return self._content(len(self.text), final=True)
        out = self._calls(calls)
        tail = self.text[self.start + rest :]
        if tail.strip():  # after the calls: content, with any space held before them
            out.append({"content": self.text[self.sent : self.start] + tail})
        return out

    def _content(self, end: int, final: bool = False) -> list[dict]:
        """Content up to `end`; space alone at the start waits (it may only precede calls)."""
        if end <= self.sent or (not final and self.sent == 0 and not self.text[:end].strip()):
            return []
        piece, self.sent = self.text[self.sent : end], end
        return [{"content": piece}]

    def _calls(self, calls: list[tuple[str, str]]) -> list[dict]:
        new = calls[self.calls_sent :]
        deltas = []
        for k, call in enumerate(_as_tool_calls(self.fmt, new)):
            deltas.append({"tool_calls": [{"index": self.calls_sent + k, **call}]})
        self.calls_sent = len(calls)
        return deltas
