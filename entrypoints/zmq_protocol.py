"""The messages of the ZMQ entrypoint (documented for other languages in docs/zmq-protocol.md).

Every message is one frame: a msgpack map whose "type" key names it. Clients connect a DEALER
socket to the server's ROUTER socket and send `generate` and `abort`; the server answers each
generate with `delta` messages (when streaming), then one `final` — or one `error`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.core.errors import InvalidParameter, validation_error_parts
from pagedllm.core.sampling_params import SamplingParams


class Generate(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
    request_id: str  # chosen by the client; unique among its requests in flight
    prompt: str | None = None  # text, or:
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = {}  # sampling parameters, named as SamplingParams names them
    stream: bool = True  # send deltas as tokens arrive; otherwise only the final message


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    request_id: str


class Delta(msgspec.Struct, tag="delta"):
    request_id: str
    index: int  # which of the n completions
    text: str  # new text (held back while it could still become a stop string)
    token_ids: list[int]  # new token ids
    logprobs: list[float] | None = None  # of the new tokens, when asked for


class Completion(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    cumulative_logprob: float | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class Final(msgspec.Struct, tag="final"):
    request_id: str
    completions: list[Completion]
    usage: Usage


class Error(msgspec.Struct, tag="error"):
    request_id: str | None  # None when the frame could not be read as a request
    code: int  # 400 bad request, 409 request id in use, 503 overloaded, 500 engine failure
    field: str | None  # the offending field, when there is one
    message: str


ClientMessage = Generate | Abort
ServerMessage = Delta | Final | Error

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(params) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidParameter(
            f"params.{unknown[0]}", f"unknown sampling parameter; known: {', '.join(sorted(_SAMPLING_FIELDS))}"
        )
    if isinstance(params.get("stop"), str):
        params = {**params, "stop": [params["stop"]]}
    try:
        return msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as e:
        path, text = validation_error_parts(e)
        if path is not None:
            raise InvalidParameter(f"params.{path}", text) from None
        cause = e.__cause__ or e.__context__
        if isinstance(cause, InvalidParameter):
            raise InvalidParameter(f"params.{cause.field}", str(cause).split(": ", 1)[-1]) from None
        field, _, message = text.partition(": ")
        raise InvalidParameter(f"params.{field}" if field in _SAMPLING_FIELDS else "params", message or text) from None
    except (TypeError, ValueError) as e:  # __post_init__ met a value of an unexpected shape
        raise InvalidParameter("params", str(e)) from None
