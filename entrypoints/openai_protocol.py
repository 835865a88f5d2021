"""Request bodies of the OpenAI-compatible API (msgspec), their translation into
SamplingParams, and the response and error bodies. Fields are OpenAI's, plus vLLM's
extra fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
use_beam_search, length_penalty, prompt_logprobs, return_token_ids, truncate_prompt_tokens,
truncation_side). Unknown fields are ignored, as OpenAI's server does. An error names the
field as the client sent it (`best_of`, `top_logprobs`, `max_completion_tokens`), not the
engine's name for it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import msgspec

from pagedllm.core.errors import InvalidParameter, validation_error_parts
from pagedllm.core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

from .json_paths import path_at, path_nested_deeper_than
from .openai_structured import ResponseFormat, Tool, constraint, forced_tools
from .sampling_fields import openai_sampling_struct, openai_values

MAX_JSON_DEPTH_SHOWN = 32  # where a too-deep body is reported: the first value this deep


def _check_seed(seed) -> None:
    """A 64-bit signed seed, as vLLM's server takes it; the error names the bound as pydantic
    does (`greater_than_equal`, `less_than_equal`), which clients of vLLM match on."""
    if isinstance(seed, int) and not isinstance(seed, bool):
        if seed < INT64_MIN:
            raise InvalidParameter("seed", f"Input should be greater than or equal to {INT64_MIN} [greater_than_equal]")
        if seed > INT64_MAX:
            raise InvalidParameter("seed", f"Input should be less than or equal to {INT64_MAX} [less_than_equal]")


def check_truncation(keep) -> None:
    """vLLM's truncate_prompt_tokens: -1 (max_model_len), a count >= 1, or None."""
    if keep is not None and (isinstance(keep, bool) or not (keep == -1 or keep >= 1)):
        raise InvalidParameter("truncate_prompt_tokens", f"must be -1 (max_model_len) or >= 1, got {keep}")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _RequestFields(msgspec.Struct, kw_only=True):
    """What completions and chat requests share beyond the sampling fields (those are
    SamplingParams', derived: `_SamplingFields` below)."""

    model: str | None = None
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    use_beam_search: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens `token_id:N` (None: the server's flag)
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] = "left"  # left: drop the start, keep the end
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs object (a sampling field)
    response_format: ResponseFormat | None = None

    # the engine's field names as this request names them (see wire_field)
    _MAX_TOKENS_FIELD = "max_tokens"
    _LOGPROBS_FIELD = "logprobs"

    def wire_field(self, field: str) -> str:
        """An engine field (SamplingParams') as this request names it."""
        if field == "beam_width":
            return "best_of" if self.best_of is not None else "n"
        if field == "max_tokens":
            return self._MAX_TOKENS_FIELD
        if field == "logprobs":
            return self._LOGPROBS_FIELD
        if field.startswith("structured_outputs"):  # named after where the constraint came from
            try:
                source = self.constraint()[1]
            except InvalidParameter:  # several sources: the error already names the field
                return field
            if source == "response_format":
                return "response_format.json_schema.schema"
            return source or field
        return field

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output's constraint and the field it came from (see openai_structured.py)."""
        return constraint(self.response_format, self.structured_outputs)

    def check(self) -> None:
        """Refusals that need no engine."""
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options", "is only allowed when stream is true")
        _check_seed(self.seed)
        check_truncation(self.truncate_prompt_tokens)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None):
        try:
            return self._sampling_params(max_tokens, logprobs, prompt_logprobs)
        except InvalidParameter as e:
            raise e.renamed(self.wire_field(e.field)) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None):
        logit_bias = self._logit_bias()
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise InvalidParameter(
                "best_of", f"must equal n ({self.n}) unless use_beam_search is set, got {self.best_of}"
            )
        if self.use_beam_search:
            width = self.best_of if self.best_of is not None else self.n
            if isinstance(width, int) and not isinstance(width, bool) and width < 1:
                raise InvalidParameter("beam_width", f"beam search needs at least one beam, got {width}")
            if self.stream:
                raise InvalidParameter("stream", "beam search results cannot be streamed")
            return SamplingParams(
                n=self.n,
                temperature=0.0,
                max_tokens=max_tokens,
                beam_width=width,
                length_penalty=self.length_penalty,
                ignore_eos=self.ignore_eos,
                structured_outputs=self.constraint()[0],
                logit_bias=logit_bias,
            )
        values = openai_values(self)
        if values.get("stop") == []:
            del values["stop"]
        values.update(
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.constraint()[0],
            logit_bias=logit_bias,
        )
        return SamplingParams(**values)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's map of token ids (as strings) to biases, keyed by int (SamplingParams checks
        the biases; the frontend, that the ids are in the vocabulary)."""
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not (key.strip().isascii() and key.strip().isdigit())]
        if bad:  # every bad key named, as vLLM names them
            shown = ", ".join(repr(k) for k in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            raise InvalidParameter("logit_bias", f"keys must be token ids (non-negative integers), got {shown}")
        return {int(key): value for key, value in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def truncation(self) -> tuple[int, str] | None:
        """(tokens to keep, "left" or "right"), or None."""
        if self.truncate_prompt_tokens is None:
            return None
        return self.truncate_prompt_tokens, self.truncation_side


_SamplingFields = openai_sampling_struct(_RequestFields)


NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any] | None = None  # a string, token ids, or a list of either (checked in prompts())
    prompt_embeds: Any = None  # vLLM's; not supported here
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts as strings or token-id lists (a completion request may carry several)."""
        p = self.prompt
        if self.prompt_embeds:
            raise InvalidParameter("prompt_embeds", "is not supported: send prompt (text or token ids)")
        if isinstance(p, str) and p:
            return [p]
        if not p:
            raise InvalidParameter("prompt", NO_PROMPT)
        if all(_is_token_id(x) for x in p):
            return [list(p)]
        for i, x in enumerate(p):
            if not (isinstance(x, str) or (isinstance(x, list) and x and all(_is_token_id(t) for t in x))):
                raise InvalidParameter(f"prompt[{i}]", "must be a string or a non-empty list of token ids")
        return list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        self.check()
        if self.suffix:
            raise InvalidParameter("suffix", "is not supported")
        max_tokens = 1 if self.echo_only else self.max_tokens  # the one token is not returned
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the prompt's tokens come with logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as the API returned them
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    reasoning: str | None = None  # an assistant's reasoning, as a reasoning parser returned it


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them. Any role is passed on (a model's
    template may know roles of its own, and refuses what it does not: a 400)."""
    if not messages:
        raise InvalidParameter("messages", "must contain at least one message")
    conv = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidParameter(f"messages[{i}].role", "must not be empty")
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
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        for key in ("name", "tool_call_id", "reasoning"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.tool_calls is not None:
            message["tool_calls"] = [
                _template_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(m.tool_calls)
            ]
        conv.append(message)
    return conv


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """The last message left open cannot also be followed by the answer's opening."""
    if continue_final_message and add_generation_prompt:
        raise InvalidParameter(
            "continue_final_message", "cannot be combined with add_generation_prompt (set it to false)"
        )


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (transformers' `tools`), or None."""
    if not tools:
        return None
    out = []
    for tool in tools:  # as sent: no keys the client left out (a template writes them with tojson)
        as_dict = msgspec.to_builtins(tool)
        as_dict["function"] = {k: v for k, v in as_dict["function"].items() if v is not None}
        out.append(as_dict)
    return out


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open, its text continued
    echo: bool = False  # the content starts with the last message's, when it is the answer's role
    tools: list[Tool] | None = None
    # auto (the default where tools are given and the server parses calls), none, required, or
    # a named function
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True  # false: only the first call an automatic choice reads is made
    chat_template_kwargs: dict | None = None  # extra variables for the template (enable_thinking)
    include_reasoning: bool = True  # false: a reasoning parser's reasoning is left out

    _LOGPROBS_FIELD = "top_logprobs"

    def wire_field(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field.startswith("structured_outputs") and self._source() == "tool_choice":
            return "tools"  # the forced function's parameters schema did not compile
        return super().wire_field(field)

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        return constraint(self.response_format, self.structured_outputs, self.tools, self.tool_choice)

    def _source(self) -> str | None:
        try:
            return self.constraint()[1]
        except InvalidParameter:
            return None

    @property
    def forced_functions(self):
        """The functions the output must call (tool_choice required or named), or None."""
        return forced_tools(self.tools, self.tool_choice)

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    @property
    def echoed(self) -> str:
        """What `echo` puts before the answer: the last message's content, where that message
        has the answer's role (the assistant's, or with add_generation_prompt off, its own)."""
        if not self.echo or not self.messages:
            return ""
        last = self.conversation()[-1]
        role = "assistant" if self.add_generation_prompt else last["role"]
        return last["content"] if last["role"] == role else ""

    def to_sampling_params(self) -> SamplingParams:
        self.check()
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        if self.stream and self.tool_choice == "required":
            raise InvalidParameter("stream", 'tool_choice "required" cannot be streamed (a named function can)')
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs)


def _template_call(call: dict, field: str) -> dict:
    """An assistant's past call for the template: its arguments an object where they are JSON
    (templates write them with tojson, as vLLM hands them over), else the text as sent."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameter(field, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": {**function, "arguments": arguments}}


def decode_body(body: bytes, kind: type):
    """Decode a JSON body; a malformed one raises InvalidParameter naming the offending field:
    also invalid UTF-8 anywhere (keys included, and fields the API ignores) and nesting too
    deep to read."""
    try:
        body.decode("utf-8")  # msgspec does not look inside what it skips
    except UnicodeDecodeError as e:
        raise InvalidParameter(path_at(body, e.start) or "body", f"is not valid UTF-8 (byte {e.start})") from None
    try:
        # lax, as vLLM's pydantic models are: "logprobs": "true", "max_tokens": "8"
        return msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.ValidationError as e:
        field, message = validation_error_parts(e)
        raise InvalidParameter(field or "body", message) from None
    except msgspec.DecodeError as e:
        raise InvalidParameter("body", f"is not valid JSON: {e}") from None
    except RecursionError:
        where = path_nested_deeper_than(body, MAX_JSON_DEPTH_SHOWN) or "body"
        raise InvalidParameter(where, "nests arrays or objects too deeply to be read") from None


def invocation_kind(body: bytes) -> type:
    """The request a SageMaker /invocations body is, as vLLM routes it: one with `messages` a
    chat completion, one with `prompt` a completion, one with `input` an embedding. Only the
    top-level keys are read (the values are skipped, not built); a malformed body raises
    InvalidParameter as decode_body does."""
    from .openai_embeddings import EmbeddingRequest

    keys = decode_body(body, dict[str, msgspec.Raw])
    if "messages" in keys:
        return ChatCompletionRequest
    if "prompt" in keys:
        return CompletionRequest
    if "input" in keys:
        return EmbeddingRequest
    raise InvalidParameter(
        "body", "needs 'messages' (a chat completion), 'prompt' (a completion) or 'input' (an embedding)"
    )


# --- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _ranked(entry, num_top: int) -> list:
    """The entry's (token id, Logprob) of the num_top most likely tokens (-1: all it holds)."""
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda item: item[1].rank)
    return ranked if num_top < 0 else ranked[:num_top]


def _token_text(token: int, lp, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids,
    for tokens whose text alone is ambiguous or not valid UTF-8)."""
    return f"token_id:{token}" if as_ids else (lp.decoded_token or "")


def completion_logprobs(entries, token_ids, offset: int, num_top: int, decode=None, as_ids: bool = False) -> dict:
    """The legacy completions `logprobs` object for some tokens and their Logprob dicts: each
    position's top_logprobs holds the sampled token and the num_top most likely (up to
    num_top + 1 entries, as OpenAI and vLLM give them). An entry of None (a prompt's first
    token, echoed) has no logprob; `decode(token)` gives its text. The offsets count the
    tokens' texts, whatever names them."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            text = decode(token) if decode is not None else ""
            name, lp, top = f"token_id:{token}" if as_ids else text, None, None
        else:
            text, name = entry[token].decoded_token or "", _token_text(token, entry[token], as_ids)
            lp = entry[token].logprob
            top = {name: lp}
            for ranked, ranked_lp in _ranked(entry, num_top):
                top.setdefault(_token_text(ranked, ranked_lp, as_ids), ranked_lp.logprob)
        tokens.append(name)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries, token_ids, num_top: int, as_ids: bool = False) -> dict:
    def item(token, lp):
        text = _token_text(token, lp, as_ids)
        return {"token": text, "logprob": lp.logprob, "bytes": list((lp.decoded_token or "").encode())}

    return {
        "content": [
            {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _ranked(entry, num_top)]}
            for token, entry in zip(token_ids, entries)
        ]
    }


def prompt_logprobs_body(entries) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else by token id its
    logprob, rank and text."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]
