"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as an
llguidance grammar, and the matchers that turn it into a per-step token mask.

llguidance (a Rust library with no Python dependencies) was chosen over xgrammar, which needs
torch: the matchers live in the engine core, which stays torch-free, and so they survive what
the core survives (a worker restart, preemption, tensor parallelism: the core sends one mask).
docs/architecture.md has the measurements behind the choice.

`grammar_of` is used by the frontend (to refuse a bad constraint before it reaches the core)
and by the core; `Grammars` compiles matchers off the engine loop (llguidance drops the GIL
while it builds one) and caches compiled grammars by content.

`StructuredOutputs` is the core's one owner of the feature's state, called at named points:
by the engine loop as requests arrive (`compile`, `take_compiled`, `abort`) and as a step is
sent (`masks`); by the scheduler as a request starts (`started`), as a step is planned
(`sampling`, `take_forced`, `blocks_planning_ahead`), as a token joins a request (`consume`,
`jump_forward`) and after a worker restart (`reset`). The worker only applies the masks
(backends/step_masks.py).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import numpy as np

from ..errors import InvalidParameter
from ..model_folder import model_folder
from ..request import EngineRequest, Request
from ..sampling_params import STRUCTURED_FIELD, StructuredOutputsParams

# JSON on one line, laid out as json.dumps does: free whitespace lets a model pad (or never end)
# a document with spaces and newlines, which small models do
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar; InvalidParameter naming the field when it is
    not valid (a schema, regex or grammar that does not compile)."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    field = f"{STRUCTURED_FIELD}.{kind}"
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
            raise InvalidParameter(f"{STRUCTURED_FIELD}.{params.kind}", f"is not valid: {matcher.get_error()}")
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


class StructuredOutputs:
    def __init__(self, jump_forward: bool = True, model: str | None = None):
        """model: the folder whose tokenizer.json the grammars are compiled against (None: the
        matchers come ready-made, as the scheduler's tests give them)."""
        self.jump_forward_on = jump_forward
        self.model = model
        self.grammars: Grammars | None = None  # made on the first constrained request
        self.compiling: dict[str, tuple[EngineRequest, Future]] = {}  # waiting for their matcher
        self.in_use = False  # some request has had a grammar
        self._forced: dict[str, list[int]] = {}  # jump-forward tokens the worker has not been sent

    # --- the engine loop: admission -------------------------------------------------------
    @staticmethod
    def constrained(request: EngineRequest) -> bool:
        return request.sampling_params.structured_outputs is not None

    def compile(self, request: EngineRequest) -> None:
        """Start compiling the request's grammar, off the loop (InvalidParameter: refused now)."""
        if self.grammars is None:
            self.grammars = self._make_grammars()
        self.compiling[request.request_id] = (
            request,
            self.grammars.compile(request.sampling_params.structured_outputs),
        )

    def _make_grammars(self) -> Grammars:
        folder = model_folder(self.model)
        path = os.path.join(self.model, "tokenizer.json")
        if not os.path.isfile(path):
            raise InvalidParameter("structured_outputs", "needs the model's tokenizer.json, which its folder lacks")
        return Grammars(path, folder.vocab_size, folder.eos_token_ids())

    def take_compiled(self) -> list[tuple[EngineRequest, object, BaseException | None]]:
        """The requests whose compilation ended: (request, matcher, None), or (request, None,
        the error: InvalidParameter where the constraint is at fault)."""
        done = []
        for rid, (request, future) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                error = future.exception()
                done.append((request, None if error else future.result(), error))
        return done

    def abort(self, request_ids) -> list[EngineRequest]:
        """Aborted while compiling: the requests dropped."""
        return [entry[0] for entry in (self.compiling.pop(rid, None) for rid in request_ids) if entry is not None]

    # --- the engine loop: a step is sent --------------------------------------------------
    def masks(self, request_ids: list[str], requests: dict[str, Request], fail) -> np.ndarray:
        """The step's token bitmasks; a request whose matcher fails here fails alone (`fail(rid,
        error)`; its row then allows every token, and what it samples is dropped with it). A
        request that ended since the step was planned (ahead: the step in flight ended it) gets
        a row that allows every token: what it samples is dropped. One whose grammar's gate is
        still shut samples freely (whether it is shut is read as the masks are sent, after the
        step in flight's tokens: the step that samples the gate's token is planned before)."""
        rows = [i for i, rid in enumerate(request_ids) if rid in requests and requests[rid].grammar_gate is None]
        bitmask = np.full((len(request_ids), self.grammars.words), -1, dtype=np.int32)  # every token
        if not rows:
            return bitmask
        try:
            computed = self.grammars.masks([requests[request_ids[i]].matcher for i in rows])
            if len(rows) == len(request_ids):
                return computed
            bitmask[rows] = computed
            return bitmask
        except Exception:  # noqa: BLE001 - find which one, and fail it alone
            for i in rows:
                rid = request_ids[i]
                try:
                    bitmask[i] = self.grammars.masks([requests[rid].matcher])[0]
                except Exception as e:  # noqa: BLE001 - logged by fail
                    fail(rid, e)
            return bitmask

    # --- the scheduler --------------------------------------------------------------------
    def started(self, request: Request, matcher, gate: int | None = None) -> None:
        """gate: the token after whose first sampling the matcher applies (None: at once)."""
        request.matcher = matcher
        request.grammar_gate = gate if matcher is not None else None
        self.in_use = self.in_use or matcher is not None

    def sampling(self, requests: list[Request]) -> list[str]:
        """The constrained requests of a step that sample in it: their masks follow the step."""
        if not self.in_use:
            return []
        return [r.request_id for r in requests if r.matcher is not None and r.num_computed_tokens == r.num_tokens]

    def blocks_planning_ahead(self, running: list[Request]) -> bool:
        """With jump-forward on, a constrained request's next step may be the tokens its
        grammar forces after the token sampled in the step in flight, not one token: that
        step waits for the results. Without it, the next step is planned ahead as any decode
        step is, and its masks follow once the step in flight's tokens have joined the grammars
        (the engine sends them late)."""
        return self.in_use and self.jump_forward_on and any(r.matcher is not None for r in running)

    @staticmethod
    def consume(request: Request, token: int) -> bool:
        """The token joins the request's grammar; whether the output is now complete. Before
        the gate's token the grammar takes nothing; the gate's token opens it."""
        if request.grammar_gate is not None:
            if token == request.grammar_gate:
                request.grammar_gate = None
            return False
        matcher = request.matcher
        if not matcher.consume_token(token):  # the mask allowed it: the grammar and the mask disagree
            raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")
        return matcher.is_stopped()

    def jump_forward(self, request: Request, new_tokens: list[int], ended_by, known: set[str]):
        """Jump-forward decoding: the tokens the grammar now admits as the only continuation
        (a schema's keys and punctuation) join the request at once, unsampled, each checked
        by `ended_by(request, token)` as a sampled one is, up to the first that ends it; the
        next step computes them in one chunk. Not where logprobs are asked for (forced tokens
        have none). Returns how the request ended, if it did."""
        shut = request.grammar_gate is not None  # (a token id: 0 is a gate too)
        if not self.jump_forward_on or request.sampling_params.logprobs is not None or shut:
            return None
        status = None
        for token in request.matcher.compute_ff_tokens():
            request.all_token_ids.append(token)
            new_tokens.append(token)
            status = ended_by(request, token)
            if status is not None:
                break
        if status is None and len(new_tokens) > 1 and request.request_id in known:
            self._forced.setdefault(request.request_id, []).extend(new_tokens[1:])
        return status

    def take_forced(self, known: set[str]) -> dict[str, list[int]]:
        """Jump-forward tokens for the worker to append, of the requests it holds."""
        if not self._forced:
            return {}
        forced = {rid: tokens for rid, tokens in self._forced.items() if rid in known}
        self._forced = {}
        return forced

    def reset(self) -> None:
        """The workers were replaced: every running request goes to them whole."""
        self._forced = {}

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
