"""Prompts in, engine requests out: text or token ids, chat templates, and the checks that
belong to the frontend (token ids within the vocabulary, room in the context, stop strings
need a tokenizer). Shared by `LLM` and `AsyncEngine`."""

from __future__ import annotations

import functools

import msgspec

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.lora import LoRARequest, read_adapter
from pagedllm.core.request import EngineRequest
from pagedllm.core.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams
from pagedllm.core.scheduling.structured import grammar_of

from .request_tracker import RequestTracker

Prompt = tuple[str | None, list[int]]  # (text if known, token ids)


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_token_ids: list[int],
        vocab_size: int,
        max_model_len: int,
        max_logprobs=20,
        pooler=None,
        lora: tuple[dict, int] | None = None,
    ):
        """lora: (the model's config.json, max_lora_rank) where the engine serves adapters."""
        self.lora = lora
        self.adapters: dict[int, LoRARequest] = {}  # checked, by id
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs  # -1: no limit
        self.pooler: PoolingParams | None = pooler  # --runner pooling: how prompts are pooled

    def adapter(self, lora: LoRARequest | None) -> LoRARequest | None:
        """A request's adapter, checked against the model (once per adapter), or None."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise InvalidParameter("lora_request", f"must be a LoRARequest, got {type(lora).__name__}")
        if self.lora is None:
            raise InvalidParameter("lora_request", "LoRA adapters need the engine started with enable_lora")
        known = self.adapters.get(lora.lora_int_id)
        if known is None:
            read_adapter(lora, *self.lora)
            self.adapters[lora.lora_int_id] = lora
        elif known != lora:
            raise InvalidParameter(
                "lora_request",
                f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}): "
                "each adapter needs its own id",
            )
        return lora

    def embedding_params(self) -> SamplingParams:
        """An embedding request's params (the engine's pooler config); refused unless the engine
        runs --runner pooling, as vLLM refuses it."""
        if self.pooler is None:
            raise InvalidParameter("model", "embeddings need the engine started with --runner pooling")
        return SamplingParams(max_tokens=1, pooling=self.pooler)

    def logprobs_asked(self, params: SamplingParams) -> SamplingParams:
        """The params with logprobs and prompt_logprobs within max_logprobs (a request's -1: the
        whole vocabulary, where max_logprobs is -1 too), and no wider than the vocabulary."""
        changes = {}
        for field in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, field)
            if asked is None:
                continue
            count = self.vocab_size if asked == -1 else asked
            if self.max_logprobs != -1 and count > self.max_logprobs:
                whole = " (-1: the whole vocabulary)" if asked == -1 else ""
                raise InvalidParameter(field, f"must be <= {self.max_logprobs} (max_logprobs), got {asked}{whole}")
            if min(count, self.vocab_size) != asked:
                changes[field] = min(count, self.vocab_size)
        return msgspec.structs.replace(params, **changes) if changes else params

    def prompts(self, prompts) -> list[Prompt]:
        """One prompt or a list: strings, token id lists, {"prompt": ...} or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = [self._prompt(p) for p in prompts]
        if not items:
            raise InvalidParameter("prompts", "no prompts given")
        for _, ids in items:
            if not ids:
                raise InvalidParameter("prompt", "must contain at least one token")
        return items

    def _prompt(self, p) -> Prompt:
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            return None, list(p)
        text = p["prompt"] if isinstance(p, dict) and "prompt" in p else p
        if not isinstance(text, str):
            raise InvalidParameter(
                "prompts",
                "each prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'",
            )
        if self.tokenizer is None:
            raise InvalidParameter("prompts", "text prompts need a tokenizer (skip_tokenizer_init is set)")
        return text, self.tokenizer.encode(text)

    def truncate(self, prompt: Prompt, keep: int, side: str = "left") -> Prompt:
        """The prompt cut to its last (side "left") or first ("right") `keep` tokens; -1 keeps
        max_model_len. A prompt that was cut has the text of the tokens kept."""
        ids = prompt[1]
        keep = self.max_model_len if keep == -1 else keep
        if len(ids) <= keep:
            return prompt
        ids = ids[len(ids) - keep :] if side == "left" else ids[:keep]
        return (self.tokenizer.decode(ids) if self.tokenizer is not None else None), ids

    def tracker(self, prompt: Prompt, params: SamplingParams, request_id: str, lora=None) -> RequestTracker:
        """The frontend's state for one request, after checking it fits this model; `lora`: its
        adapter, checked by adapter()."""
        params = self.logprobs_asked(params)
        if self.pooler is not None and params.pooling is None:
            raise InvalidParameter(
                "model",
                "this engine runs --runner pooling: it computes embeddings (/v1/embeddings, LLM.embed), not text",
            )
        text, ids = prompt
        if len(ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                f"which leaves room for at most {self.max_model_len - 1}",
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:  # (vLLM's words: clients match on "out of vocabulary")
            raise InvalidParameter(
                "prompt_token_ids",
                f"token id {bad[0]} is out of vocabulary (ids are in [0, {self.vocab_size})); "
                f"{len(bad)} such id{'s' if len(bad) > 1 else ''}",
            )
        for field in ("stop_token_ids", "logit_bias"):
            bad = next((t for t in getattr(params, field) or () if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter(
                    field, f"token id {bad} is out of vocabulary (ids are in [0, {self.vocab_size}))"
                )
        if self.tokenizer is None and params.stop:
            raise InvalidParameter("stop", "stop strings need a tokenizer (skip_tokenizer_init is set)")
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs)
        tracker = RequestTracker(request_id, text, ids, params, self.tokenizer)
        tracker.lora = lora
        return tracker

    def check_room(self, prompt: Prompt, params: SamplingParams) -> None:
        """The server's rule (OpenAI's and vLLM's): prompt + max_tokens must fit the context."""
        ids = prompt[1]
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)}, so max_tokens can be at most "
                f"{max(self.max_model_len - len(ids), 0)}, got {params.max_tokens}",
            )

    def engine_request(self, tracker: RequestTracker, arrival_time: float, final_only: bool = False) -> EngineRequest:
        return EngineRequest(
            final_only=final_only,
            request_id=tracker.request_id,
            prompt_token_ids=tracker.output.prompt_token_ids,
            sampling_params=tracker.params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
            structured_outputs_after=tracker.structured_outputs_after,
            lora=tracker.lora,
        )

    def render_chat(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> dict:
        """A conversation as a prompt dict (text and token ids), through the tokenizer's template
        (continue_final_message: the last message left open, for the model to go on with). A
        conversation the template refuses (its raise_exception, e.g. "roles must alternate") is
        an InvalidParameter with the template's message. tools: the functions the template
        describes to the model; template_kwargs: more variables for it (enable_thinking)."""
        from jinja2 import TemplateError

        if self.tokenizer is None:
            raise InvalidParameter("messages", "chat needs a tokenizer (skip_tokenizer_init is set)")
        if getattr(self.tokenizer, "chat_template", None) is None and chat_template is None:
            raise InvalidParameter("messages", "the model's tokenizer has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(template_kwargs or {}),
            )
        except ValueError as e:  # transformers': e.g. continue_final_message with an empty last message
            raise InvalidParameter("continue_final_message", str(e)) from None
        except TemplateError as e:
            raise InvalidParameter("messages", f"the chat template refused the conversation: {e}") from None
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}


def check_structured(params: StructuredOutputsParams) -> None:
    """A constraint that does not compile is refused here, naming its field, before the
    request reaches the engine core (the grammar is remembered: checking it again is free)."""
    _checked_grammar(msgspec.json.encode(params))


@functools.lru_cache(maxsize=256)
def _checked_grammar(encoded: bytes) -> None:
    grammar_of(msgspec.json.decode(encoded, type=StructuredOutputsParams))


def per_prompt(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidParameter("sampling_params", f"needs one per prompt ({n}), got {len(params)}")
    return list(params)
