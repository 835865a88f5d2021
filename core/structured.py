"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as an
llguidance grammar, and the matchers that turn it into a per-step token mask.

llguidance (a Rust library with no Python dependencies) was chosen over xgrammar, which needs
torch: the matchers live in the engine core, which stays torch-free, and so they survive what
the core survives (a worker restart, preemption, tensor parallelism: the core sends one mask).
docs/architecture.md has the measurements behind the choice.

`grammar_of` is used by the frontend (to refuse a bad constraint before it reaches the core)
and by the core; `Grammars` compiles matchers off the engine loop (llguidance drops the GIL
while it builds one) and caches compiled grammars by content.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import numpy as np

from .errors import InvalidParameter

FIELD = "structured_outputs"
# JSON on one line, laid out as json.dumps does: free whitespace lets a model pad (or never end)
# a document with spaces and newlines, which small models do
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One constraint on a request's output, named as vLLM names them: `json` (a JSON schema,
    as a dict or its text), `regex`, `choice` (the output is one of these strings), `grammar`
    (Lark, or llama.cpp's GBNF), or `json_object` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameter(
                FIELD, f"give exactly one of json, regex, choice, grammar or json_object, got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter(f"{FIELD}.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


def grammar_of(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar; InvalidParameter naming the field when it is
    not valid (a schema, regex or grammar that does not compile)."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    field = f"{FIELD}.{kind}"
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, dict):
                raise InvalidParameter(field, "must be a JSON schema: an object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            grammar = grammar_from("choice", json.dumps(params.choice))
        else:
            grammar = grammar_from("grammar", params.grammar)  # Lark or GBNF
    except InvalidParameter:
        raise
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise InvalidParameter(field, f"is not valid: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidParameter(field, f"is not valid: {error.strip()}")
    return grammar


def vocab_words(vocab_size: int) -> int:
    """int32 words of a token bitmask (bit t of word t // 32 set: token t allowed)."""
    return (vocab_size + 31) // 32


class Grammars:
    """The engine core's grammar compiler: an llguidance tokenizer made from the model folder's
    tokenizer.json, matchers built on a background thread, compiled grammars kept by content."""

    def __init__(self, tokenizer_json_path: str, vocab_size: int, eos_token_ids: list[int]):
        self.path, self.vocab_size, self.eos = tokenizer_json_path, vocab_size, list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
        self._grammars: dict[str, str] = {}  # constraint (canonical JSON) -> llguidance grammar
        self._executor = None  # llguidance's thread pool for masks

    @property
    def words(self) -> int:
        return vocab_words(self.vocab_size)

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                with open(self.path) as f:
                    self._tokenizer = LLTokenizer(f.read(), n_vocab=self.vocab_size, eos_token=self.eos or None)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of a fresh LLMatcher for the constraint (raises InvalidParameter)."""
        return self._pool.submit(self._matcher, params)

    def _matcher(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        key = json.dumps(msgspec.to_builtins(params), sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._grammars[key] = grammar_of(params)
        matcher = LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidParameter(f"{FIELD}.{params.kind}", f"is not valid: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: list) -> np.ndarray:
        """The tokens each matcher allows next, as bitmask rows (int32 [len(matchers), words]),
        computed in parallel by llguidance's threads (it drops the GIL)."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        bitmask = np.empty((len(matchers), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, self.words * 4, len(matchers)
        )
        return bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
