"""The messages of the ZMQ entrypoint (documented for other languages in docs/zmq-protocol.md).

Every message is one frame: a msgpack map whose "type" key names it. Clients connect a DEALER
socket to the server's ROUTER socket and send `generate` and `abort`; the server answers each
generate with `delta` messages (when streaming), then one `final` — or one `error`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.core.errors import InvalidParameter, validation_error_parts
from pagedllm.core.lora import LoRARequest
from pagedllm.core.sampling_params import SamplingParams


class Generate(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
    request_id: str  # chosen by the client; unique among its requests in flight
    prompt: str | None = None  # text, or:
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = {}  # sampling parameters, named as SamplingParams names them
    stream: bool = True  # send deltas as tokens arrive; otherwise only the final message


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    request_id: str


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """Is the server ready? Answered with `ready` (queued by ZeroMQ until the server is up)."""


class Ready(msgspec.Struct, tag="ready"):
    model: str  # the served model's name
    max_model_len: int  # prompt + output tokens of one request, at most


class Delta(msgspec.Struct, tag="delta"):
    request_id: str
    index: int  # which of the n completions
    text: str  # new text (held back while it could still become a stop string)
    token_ids: list[int]  # new token ids
    logprobs: list[float] | None = None  # of the new tokens, when params.logprobs was set
    # per new token, the params.logprobs most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None


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
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class Final(msgspec.Struct, tag="final"):
    request_id: str
    completions: list[Completion]
    usage: Usage
    # with params.prompt_logprobs: per prompt token (None for the first) its logprob, and the
    # prompt_logprobs most likely (token id, logprob) in its place
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class Error(msgspec.Struct, tag="error"):
    request_id: str | None  # None when the frame could not be read as a request
    code: int  # 400 bad request, 409 request id in use, 503 overloaded, 500 engine failure
    field: str | None  # the offending field, when there is one
    message: str


ClientMessage = Generate | Abort | Hello
ServerMessage = Delta | Final | Error | Ready

_TOP_FIELDS = frozenset(Generate.__struct_fields__) | {"type"}

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def wire_field(field: str | None) -> str | None:
    """An engine field named as a client names it: sampling parameters live under `params`."""
    if field == "prompts":  # what the Python API calls its argument
        return "prompt"
    if field is None or field in _TOP_FIELDS or field.startswith("params"):
        return field
    return f"params.{field}" if field.split(".")[0] in _SAMPLING_FIELDS else field


def readable_request_id(frame: bytes) -> str | None:
    """The string `request_id` of a frame that is a msgpack map, whatever else is wrong with it."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def invalid_message(error: msgspec.ValidationError) -> tuple[str | None, str]:
    """(field, message) of a frame that does not decode as a client message."""
    field, message = validation_error_parts(error)
    if field is None and message.startswith("Object contains unknown field"):
        field = message.split("`")[1]
    return field, message


def lora_request(params: dict[str, Any]) -> LoRARequest | None:
    """params.lora: {"lora_name", "lora_int_id", "lora_path"} (vLLM's LoRARequest), or None."""
    lora = params.get("lora")
    if lora is None:
        return None
    try:
        return msgspec.convert(lora, LoRARequest)
    except msgspec.ValidationError as e:
        path, text = validation_error_parts(e)
        raise InvalidParameter("params.lora" + (f".{path}" if path else ""), text) from None


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    params = {k: v for k, v in params.items() if k != "lora"}  # the adapter: lora_request()
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
