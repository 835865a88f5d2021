"""Sampling parameters, with vLLM's field names and ranges."""

from __future__ import annotations

import math

import msgspec

from .errors import InvalidParameter

# below this a temperature is greedy decoding, as in vLLM: dividing logits by 1e-38 overflows
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
# |length_penalty| at most this: a beam's score, cum_logprob / len ** length_penalty, is then a
# finite float32 for any length up to 2**20 tokens (at most 2**25 nats: 2**100 * 2**25 < 2**128)
MAX_LENGTH_PENALTY = 5.0
MAX_BEAM_WIDTH = 10
MAX_LOGIT_BIAS = 100  # OpenAI's range: -100 bans a token, 100 all but forces it


STRUCTURED_FIELD = "structured_outputs"  # StructuredOutputsParams' name in SamplingParams


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
            message = f"give exactly one of json, regex, choice, grammar or json_object, got {given or 'none'}"
            raise InvalidParameter(STRUCTURED_FIELD, message)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter(f"{STRUCTURED_FIELD}.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many most likely
    priority: int = 0  # lower runs first under the `priority` policy, as in vLLM
    beam_width: int = 0  # > 0: beam search with this many beams (see LLM.beam_search)
    length_penalty: float = 1.0  # beam search: hypotheses score sum_logprobs / len ** length_penalty
    # the output follows this constraint (JSON schema, regex, choice, grammar): see core/scheduling/structured.py
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit before anything else (penalties, masks, logprobs, sampling)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("n", self.n, lo=1)
        _check_float("temperature", self.temperature, lo=0.0)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=-1, hi=INT64_MAX)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=INT64_MAX)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for token_id in self.stop_token_ids or ():
            _check_int("stop_token_ids", token_id, lo=0, hi=TOKEN_ID_MAX)
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop", f"each stop string must be a non-empty string, got {s!r}")
        # -1: the whole vocabulary; the frontend caps both at the engine's max_logprobs
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=-1, hi=TOKEN_ID_MAX)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=-1, hi=TOKEN_ID_MAX)
            if self.beam_width:
                raise InvalidParameter("prompt_logprobs", "is not supported with beam search")
        _check_int("priority", self.priority, lo=INT64_MIN, hi=INT64_MAX)
        _check_int("beam_width", self.beam_width, lo=0, hi=MAX_BEAM_WIDTH)
        _check_length_penalty(self.length_penalty)
        if self.beam_width and self.n > self.beam_width:
            raise InvalidParameter(
                "n", f"beam search returns at most its beams: must be <= {self.beam_width}, got {self.n}"
            )
        if self.structured_outputs is not None:
            self._check_structured()
        if self.logit_bias is not None:
            self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidParameter(
                "logit_bias", f"must be a map of token id to bias, got {type(self.logit_bias).__name__}"
            )
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= TOKEN_ID_MAX:
                raise InvalidParameter("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            ):
                raise InvalidParameter(
                    "logit_bias",
                    f"biases must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias!r} for {token}",
                )

    def _check_structured(self) -> None:
        if isinstance(self.structured_outputs, dict):  # as a Python caller may give it
            try:
                self.structured_outputs = msgspec.convert(self.structured_outputs, StructuredOutputsParams)
            except msgspec.ValidationError as e:
                raise InvalidParameter("structured_outputs", str(e)) from None
        if self.beam_width:
            raise InvalidParameter("structured_outputs", "is not supported with beam search")
        if self.min_tokens:
            raise InvalidParameter(
                "min_tokens", "cannot be combined with structured_outputs (the grammar decides the end)"
            )
        # whether the constraint compiles is checked by the frontend (InputProcessor), once


def _check_length_penalty(value) -> None:
    _check_float("length_penalty", value, lo=-MAX_LENGTH_PENALTY, hi=MAX_LENGTH_PENALTY)


def _check_int(field: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(field, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidParameter(field, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidParameter(field, f"must be <= {hi}, got {value}")


def _check_float(field: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameter(field, f"must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidParameter(field, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidParameter(field, f"must be <= {hi}, got {value}")


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Parameters of LLM.beam_search, as vLLM names them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        _check_int("beam_width", self.beam_width, lo=1, hi=MAX_BEAM_WIDTH)
        _check_int("max_tokens", self.max_tokens, lo=1, hi=INT64_MAX)
        _check_length_penalty(self.length_penalty)
        if self.temperature != 0.0:
            raise InvalidParameter("temperature", f"beam search is deterministic: must be 0, got {self.temperature}")

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
        )
