"""Where in a JSON body a problem is, for bodies the decoder refuses without saying where: the
path (`messages[0].content`) of the value holding a byte offset (invalid UTF-8), or of the
first value nested deeper than a limit. Only run on a body already refused, so a plain scan
in Python is cheap enough; it tolerates the malformed input it is given."""

from __future__ import annotations

import re

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[\]{}:,]', re.DOTALL)
SHOWN_PARTS = 4  # a path deeper than this is cut (a nesting bomb's would be thousands long)


class _Frame:
    __slots__ = ("is_object", "key", "index", "expect_key")

    def __init__(self, is_object: bool):
        self.is_object = is_object
        self.key: str | None = None
        self.index = 0
        self.expect_key = is_object


def _path(stack: list[_Frame]) -> str | None:
    parts = []
    for frame in stack[:SHOWN_PARTS]:
        if frame.is_object:
            if frame.key is None:
                break
            parts.append(("." if parts else "") + frame.key)
        else:
            parts.append(f"[{frame.index}]")
    if len(stack) > SHOWN_PARTS:
        parts.append("...")
    return "".join(parts) or None


def _scan(body: bytes, stop):
    """Walk the tokens; `stop(stack, start, end, is_key)` returning True ends the walk with
    the path then current. Returns that path, or None."""
    stack: list[_Frame] = []
    for m in _TOKENS.finditer(body):
        tok = m.group()
        top = stack[-1] if stack else None
        if tok in (b"{", b"["):
            stack.append(_Frame(tok == b"{"))
            if stop(stack, m.start(), m.end(), False):
                return _path(stack[:-1])
        elif tok in (b"}", b"]"):
            if stack:
                stack.pop()
        elif tok == b",":
            if top is not None:
                if top.is_object:
                    top.expect_key, top.key = True, None
                else:
                    top.index += 1
        elif tok == b":":
            if top is not None:
                top.expect_key = False
        else:  # a string
            is_key = top is not None and top.is_object and top.expect_key
            if is_key:
                top.key = tok[1:-1].decode("utf-8", "replace")
            if stop(stack, m.start(), m.end(), is_key):
                return _path(stack)
    return None


def path_at(body: bytes, offset: int) -> str | None:
    """The path of the value (or key) whose text holds byte `offset`."""
    return _scan(body, lambda stack, start, end, is_key: end > offset)


def path_nested_deeper_than(body: bytes, depth: int) -> str | None:
    """The path of the first array or object that opens deeper than `depth` levels."""
    return _scan(body, lambda stack, start, end, is_key: len(stack) > depth)
