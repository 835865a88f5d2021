"""Reasoning models' thinking, split from their answer (`--reasoning-parser`, vLLM's names):
the text between `<think>` and `</think>` goes to the message's `reasoning` field (vLLM's name
since v0.11.1, which dropped the older `reasoning_content`), what follows is the content.

- deepseek_r1: the output is reasoning from its start (the template may have written the
  `<think>` into the prompt) until `</think>`; an output cut short before it is all reasoning.
- qwen3: the output is reasoning only where it starts with `<think>`, or the prompt opened one;
  otherwise (thinking turned off: the template closed an empty `<think></think>` in the prompt)
  it is all content.

A whole answer is split by streaming its whole text at once, so the streamed deltas and the
whole message always agree. Structured outputs constrain only the content: the engine applies
a request's grammar from the first `</think>` token its output samples (see `constraint_gate`).
"""

from __future__ import annotations

from .detokenizer import held_back

START, END = "<think>", "</think>"


class ReasoningFormat:
    def __init__(self, name: str, always_thinks: bool):
        self.name = name
        self.always_thinks = always_thinks  # deepseek_r1: thinking whether or not it opened

    def thinking_in_prompt(self, prompt: str) -> bool | None:
        """Whether the prompt leaves the output thinking (True), done with it (False), or says
        nothing (None: the output's start decides, or deepseek_r1 thinks)."""
        opened, closed = prompt.rfind(START), prompt.rfind(END)
        if closed > opened:
            return False
        if opened > closed:
            return True
        return None

    def thinks_at_start(self, prompt: str) -> bool | None:
        """Whether the output starts in thinking; None where its first characters decide."""
        in_prompt = self.thinking_in_prompt(prompt)
        if in_prompt is not None:
            return in_prompt
        return True if self.always_thinks else None


REASONING_FORMATS = {"deepseek_r1": ReasoningFormat("deepseek_r1", True), "qwen3": ReasoningFormat("qwen3", False)}


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; known: {', '.join(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]


class StreamedReasoning:
    """One choice's text in; ("reasoning" | "content", text) pieces out."""

    def __init__(self, fmt: ReasoningFormat, prompt: str):
        self.thinking = fmt.thinks_at_start(prompt)  # None: undecided until the output shows
        self.text = ""
        self.sent = 0  # characters of text handed on
        self.done_thinking = False

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.text += delta
        return self._pieces(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._pieces(final=True)

    def _pieces(self, final: bool) -> list[tuple[str, str]]:
        if self.thinking is None:  # does the output open with <think>?
            rest = self.text.lstrip()
            if rest.startswith(START):
                self.thinking = True
            elif START.startswith(rest) and not final:
                return []
            else:
                self.thinking = False
        if not self.thinking or self.done_thinking:
            return self._hand_on("content", len(self.text))
        if self.sent == 0:  # the opening tag (and space before it) is no part of the reasoning
            rest = self.text.lstrip()
            if rest.startswith(START):
                self.sent = len(self.text) - len(rest) + len(START)
            elif START.startswith(rest) and not final:
                return []
        end = self.text.find(END, self.sent)
        if end < 0:
            return self._hand_on("reasoning", len(self.text) - (0 if final else held_back(self.text, END)))
        out = self._hand_on("reasoning", end)
        self.sent = end + len(END)
        self.done_thinking = True
        return out + self._hand_on("content", len(self.text))

    def _hand_on(self, kind: str, end: int) -> list[tuple[str, str]]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : end], end
        return [(kind, piece)]


def split_reasoning(fmt: ReasoningFormat, prompt: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None where a part is empty."""
    stream = StreamedReasoning(fmt, prompt)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.thinking else None), (content or None)


def constraint_gate(fmt: ReasoningFormat, prompt: str, end_token_id: int) -> int | None:
    """The token after whose first sampling a request's grammar applies: `</think>` where the
    output may think first; None where the prompt already ended the thinking."""
    return None if fmt.thinking_in_prompt(prompt) is False else end_token_id
