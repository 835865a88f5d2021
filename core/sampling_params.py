"""Sampling parameters, with vLLM's field names and ranges."""

from __future__ import annotations

import functools
import math
import typing
from typing import Annotated, NamedTuple

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


POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An embedding request (vLLM's pooler config): the prompt's final hidden states (after the
    last norm) pooled into one vector — the last token's (LAST), their mean (MEAN) or the first
    token's (CLS) — and L2-normalised where `normalize`. No token is generated."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidParameter(
                "pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidParameter("normalize", f"must be true or false, got {self.normalize!r}")


def declared(
    help: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    openai=True,
    openai_type=None,
    cli=True,
    flag: str | None = None,
) -> msgspec.Meta:
    """A sampling field's declaration, beside its type and default: its help, the bounds
    __post_init__ checks (lo, hi; lo_open: lo itself is out), and how the OpenAI request models
    and the CLI's flags take it (entrypoints/sampling_fields.py derives both). openai: False
    where the requests declare it themselves (their own names or defaults); openai_type: the
    request's type where JSON gives it another. cli: False for no flag, else the flag's default
    where it differs from the Python API's (stated here, once); flag: the flag's name where it
    is not --field-name."""
    extra = {"lo": lo, "hi": hi, "lo_open": lo_open, "openai": openai, "openai_type": openai_type}
    return msgspec.Meta(description=help, extra={**extra, "cli": cli, "flag": flag})


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a request samples, with vLLM's field names and ranges. Each field is declared once,
    here: its default, help and bounds; the OpenAI request models and the CLI derive from them."""

    n: Annotated[int, declared("completions to return for the prompt", lo=1)] = 1
    temperature: Annotated[
        float, declared("how random sampling is; 0 is greedy", lo=0.0, cli=0.0)  # the CLI is greedy by default
    ] = 1.0
    top_p: Annotated[
        float,
        declared("sample from the likeliest tokens whose probability adds up to this", lo=0.0, lo_open=True, hi=1.0),
    ] = 1.0
    top_k: Annotated[int, declared("sample from this many most likely tokens (0 or -1: all)", lo=-1, hi=INT64_MAX)] = 0
    min_p: Annotated[
        float, declared("drop tokens less likely than this fraction of the most likely one", lo=0.0, hi=1.0)
    ] = 0.0
    presence_penalty: Annotated[float, declared("penalize tokens already in the output", lo=-2.0, hi=2.0)] = 0.0
    frequency_penalty: Annotated[
        float, declared("penalize tokens by how often they are in the output", lo=-2.0, hi=2.0)
    ] = 0.0
    repetition_penalty: Annotated[
        float, declared("divide the logits of tokens in the prompt or output by this", lo=0.0, lo_open=True)
    ] = 1.0
    seed: Annotated[
        int | None, declared("the request's own seed", lo=INT64_MIN, hi=2**64 - 1, flag="--sampling-seed")
    ] = None
    max_tokens: Annotated[
        int | None,
        declared("output tokens at most (None: until max_model_len)", lo=1, hi=INT64_MAX, openai=False, cli=64),
    ] = 16
    min_tokens: Annotated[int, declared("output tokens before EOS or a stop may end it", lo=0, hi=INT64_MAX)] = 0
    stop: Annotated[str | list[str] | None, declared("strings that end the output (not included in it)")] = None
    stop_token_ids: Annotated[list[int] | None, declared("token ids that end the output")] = None
    ignore_eos: Annotated[bool, declared("go on past EOS")] = False
    skip_special_tokens: Annotated[bool, declared("leave special tokens out of the output's text", cli=False)] = True
    # -1: the whole vocabulary; the frontend caps both at the engine's max_logprobs
    logprobs: Annotated[
        int | None,
        declared("the logprob of each output token, and this many most likely", lo=-1, hi=TOKEN_ID_MAX, openai=False),
    ] = None
    prompt_logprobs: Annotated[
        int | None,
        declared("per prompt token: its logprob and this many most likely", lo=-1, hi=TOKEN_ID_MAX, cli=False),
    ] = None
    priority: Annotated[
        int, declared("lower runs first under the priority policy, as in vLLM", lo=INT64_MIN, hi=INT64_MAX, cli=False)
    ] = 0
    beam_width: Annotated[
        int,
        declared("> 0: beam search with this many beams", lo=0, hi=MAX_BEAM_WIDTH, openai=False),
    ] = 0
    length_penalty: Annotated[
        float,
        declared(
            "beam search: a hypothesis scores sum_logprobs / len ** length_penalty",
            lo=-MAX_LENGTH_PENALTY,
            hi=MAX_LENGTH_PENALTY,
        ),
    ] = 1.0
    structured_outputs: Annotated[
        StructuredOutputsParams | None,
        declared("the output follows this constraint (JSON schema, regex, choice, grammar)", cli=False),
    ] = None
    logit_bias: Annotated[
        dict[int, float] | None,
        declared(
            "token id -> added to its logit before anything else (penalties, masks, logprobs, sampling)",
            openai_type=dict[str, float] | None,  # JSON's keys are strings (the frontend reads them)
            cli=False,
        ),
    ] = None

    pooling: Annotated[
        PoolingParams | None,
        declared("pool the prompt's hidden states into an embedding instead of generating", openai=False, cli=False),
    ] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, is_int, lo, hi, lo_open in bounded_fields(type(self)):
            value = getattr(self, name)
            if value is None:
                continue
            if is_int:
                _check_int(name, value, lo, hi)
            else:
                _check_float(name, value, lo, hi, lo_open)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for token_id in self.stop_token_ids or ():
            _check_int("stop_token_ids", token_id, lo=0, hi=TOKEN_ID_MAX)
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop", f"each stop string must be a non-empty string, got {s!r}")
        if self.prompt_logprobs is not None and self.beam_width:
            raise InvalidParameter("prompt_logprobs", "is not supported with beam search")
        if self.pooling is not None and (self.n != 1 or self.beam_width or self.prompt_logprobs is not None):
            raise InvalidParameter(
                "pooling", "an embedding is one vector of the prompt: no n, beams or prompt_logprobs"
            )
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


class FieldDeclaration(NamedTuple):
    name: str
    type: object  # the annotation, without its declaration
    default: object
    help: str
    extra: dict  # declared()'s keywords


@functools.cache
def field_declarations(cls=None) -> tuple[FieldDeclaration, ...]:
    """Each field of SamplingParams (or a subclass) with its declaration, in order."""
    cls = cls or SamplingParams
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in msgspec.structs.fields(cls):
        base, meta = typing.get_args(hints[f.name])[:2]
        out.append(FieldDeclaration(f.name, base, f.default, meta.description, meta.extra))
    return tuple(out)


@functools.cache
def bounded_fields(cls) -> tuple[tuple[str, bool, float | None, float | None, bool], ...]:
    """(name, whether an integer, lo, hi, lo_open) of the fields declared with bounds."""
    out = []
    for d in field_declarations(cls):
        if d.extra["lo"] is not None or d.extra["hi"] is not None:
            is_int = int in (typing.get_args(d.type) or (d.type,))
            out.append((d.name, is_int, d.extra["lo"], d.extra["hi"], d.extra["lo_open"]))
    return tuple(out)


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
