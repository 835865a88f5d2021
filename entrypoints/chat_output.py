"""A chat choice's text as the message's parts: the reasoning (a reasoning parser's), the
content, and the tool calls read from the content (an automatic tool choice's parser). The same
pieces make the streamed deltas and, fed the whole text at once, the whole message."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .reasoning_parsers import END, ReasoningFormat, StreamedReasoning, reasoning_format
from .tool_parsers import TOOL_CALL_FORMATS, StreamedToolCalls, ToolCallFormat, tool_call_format


class ChatOutputParser:
    def __init__(
        self,
        reasoning: ReasoningFormat | None,
        prompt: str,
        tools: ToolCallFormat | None,
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ):
        self.reasoning = StreamedReasoning(reasoning, prompt) if reasoning is not None else None
        self.tools = StreamedToolCalls(tools) if tools is not None else None
        self.include_reasoning = include_reasoning
        self.parallel_tool_calls = parallel_tool_calls

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    @property
    def thought(self) -> bool:
        return self.reasoning is not None and bool(self.reasoning.thinking)

    def feed(self, text: str) -> list[dict]:
        """The deltas the new text completes: {"reasoning": ...}, {"content": ...} or {"tool_calls": [...]}."""
        if self.reasoning is None:
            return self._content(text, final=False)
        return self._parts(self.reasoning.feed(text), final=False)

    def finish(self) -> list[dict]:
        if self.reasoning is None:
            return self._content("", final=True)
        return self._parts(self.reasoning.finish(), final=True)

    def _parts(self, pieces: list[tuple[str, str]], final: bool) -> list[dict]:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                if self.include_reasoning:
                    out.append({"reasoning": text})
            else:
                out += self._content(text, final=False)
        return out + (self._content("", final=True) if final else [])

    def _content(self, text: str, final: bool) -> list[dict]:
        if self.tools is None:
            return [{"content": text}] if text else []
        deltas = self.tools.feed(text) if text else []
        deltas += self.tools.finish() if final else []
        if not self.parallel_tool_calls:  # only the first call is made
            deltas = [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        return deltas

    def message(self, text: str) -> dict:
        """The whole message's parts: reasoning (where it thought), content (None where empty)
        and tool_calls (where it called)."""
        deltas = self.feed(text) + self.finish()
        parts = {"content": "".join(d.get("content", "") for d in deltas) or None}
        if self.thought and self.include_reasoning:
            parts["reasoning"] = "".join(d.get("reasoning", "") for d in deltas)
        calls = [{k: v for k, v in d["tool_calls"][0].items() if k != "index"} for d in deltas if "tool_calls" in d]
        if calls:
            parts["tool_calls"] = calls
        return parts


# apply_chat_template's own arguments: not variables a request may set through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset(
    [
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    ]
)


@dataclass
class ChatOptions:
    """The server's chat flags, as vLLM names them: --chat-template (a file or the template
    itself), --enable-auto-tool-choice with --tool-call-parser, and --reasoning-parser."""

    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tokenizer_info: bool = False  # GET /tokenizer_info answers (--enable-tokenizer-info-endpoint)

    def check(self) -> None:
        """Refusals that need no engine (ValueError naming the flag)."""
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_FORMATS)})")
        if self.tool_call_parser is not None:
            tool_call_format(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)
        self.template()

    def template(self) -> str | None:
        value = self.chat_template
        if value is None:
            return None
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return f.read()
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")

    @property
    def tool_format(self) -> ToolCallFormat | None:
        """The format automatic tool calls are read in, or None where they are off."""
        return tool_call_format(self.tool_call_parser) if self.enable_auto_tool_choice else None

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        return reasoning_format(self.reasoning_parser) if self.reasoning_parser is not None else None


def reasoning_end_token(tokenizer, fmt: ReasoningFormat) -> int:
    """The token id of `</think>`, which must be one token: the engine opens a request's grammar
    when it samples it."""
    ids = tokenizer.encode(END, add_special_tokens=False) if tokenizer is not None else []
    if len(ids) != 1:
        raise ValueError(f"--reasoning-parser {fmt.name}: the model's tokenizer has no single token for {END!r}")
    return ids[0]
