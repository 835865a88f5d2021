"""Request bodies of the OpenAI-compatible API (msgspec), their translation into
SamplingParams, and the response and error bodies. Fields are OpenAI's, plus vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, use_beam_search). Unknown fields are ignored, as OpenAI's server does."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from pagedllm.core.errors import InvalidParameter, validation_error_parts
from pagedllm.core.sampling_params import SamplingParams


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise InvalidParameter("logit_bias", "is not supported")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise InvalidParameter(
                "best_of", f"must equal n ({self.n}) unless use_beam_search is set, got {self.best_of}"
            )
        if self.use_beam_search:
            width = self.best_of if self.best_of is not None else self.n
            if self.n != 1:
                raise InvalidParameter("n", f"beam search returns the best beam: must be 1, got {self.n}")
            if self.stream:
                raise InvalidParameter("stream", "beam search results cannot be streamed")
            return SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                beam_width=width,
                length_penalty=self.length_penalty,
                ignore_eos=self.ignore_eos,
            )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked in prompts())
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts as strings or token-id lists (a completion request may carry several)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidParameter("prompt", "must not be empty")
        if all(_is_token_id(x) for x in p):
            return [list(p)]
        for i, x in enumerate(p):
            if not (isinstance(x, str) or (isinstance(x, list) and x and all(_is_token_id(t) for t in x))):
                raise InvalidParameter(f"prompt[{i}]", "must be a string or a non-empty list of token ids")
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidParameter("echo", "is not supported")
        if self.suffix:
            raise InvalidParameter("suffix", "is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise InvalidParameter("messages", "must contain at least one message")
        conv = []
        for i, m in enumerate(self.messages):
            if m.role not in ("system", "user", "assistant", "developer", "tool"):
                raise InvalidParameter(f"messages[{i}].role", f"unknown role {m.role!r}")
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise InvalidParameter(
                            f"messages[{i}].content[{j}]", f"only text parts are supported, got type {part.type!r}"
                        )
                    texts.append(part.text)
                content = "".join(texts)
            else:
                content = m.content or ""
            conv.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return conv

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


def decode_body(body: bytes, kind: type):
    """Decode a JSON body; a malformed one raises InvalidParameter naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        field, message = validation_error_parts(e)
        raise InvalidParameter(field or "body", message) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise InvalidParameter("body", f"is not valid JSON: {e}") from None


# --- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _ranked(entry, num_top: int):
    return sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)[:num_top]


def completion_logprobs(entries, token_ids, offset: int, num_top: int) -> dict:
    """The legacy completions `logprobs` object for some tokens and their Logprob dicts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = entry[token].decoded_token or ""
        tokens.append(text)
        token_lps.append(entry[token].logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in _ranked(entry, num_top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries, token_ids, num_top: int) -> dict:
    def item(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(entry[token]), "top_logprobs": [item(lp) for lp in _ranked(entry, num_top)]}
            for token, entry in zip(token_ids, entries)
        ]
    }
