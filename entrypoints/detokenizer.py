"""Incremental detokenization and stop strings, per completion.

Each step decodes only a short window of recent tokens: the text of
ids[prefix_offset:read_offset] is already emitted; whatever ids[prefix_offset:] decodes to
beyond it is new — unless it ends in U+FFFD, i.e. a multi-byte character is still split
across tokens, in which case nothing is emitted until the rest arrives.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first outputs (leading-space rules)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly complete text."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character stays U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last `new_chars` characters of text:
    (where it starts, which one)."""
    if not stops or not new_chars:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - new_chars - longest + 1)
    best = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker` (a parser holds
    them back until the next text tells)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
