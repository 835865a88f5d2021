"""vLLM's /tokenize and /detokenize: a prompt (or chat messages, through the chat template) to
token ids, and token ids back to text, with the model's own tokenizer."""

from __future__ import annotations

import msgspec

from pagedllm.core.errors import InvalidParameter

from .openai_protocol import ChatMessage, check_continuation, conversation, template_tools
from .openai_structured import Tool


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's two bodies in one: `prompt`, or chat `messages` (with their template's options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def tokenize(req: TokenizeRequest, engine, render_chat, max_model_len: int) -> dict:
    """render_chat(conversation, add_generation_prompt, continue_final_message, tools, kwargs) -> prompt dict."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidParameter("prompt", "tokenizing needs the model's tokenizer (skip_tokenizer_init is set)")
    if (req.prompt is None) == (req.messages is None):
        raise InvalidParameter("prompt", "give either prompt or messages")
    if req.messages is not None:
        check_continuation(req.continue_final_message, req.add_generation_prompt)
        text = render_chat(
            conversation(req.messages),
            req.add_generation_prompt,
            req.continue_final_message,
            template_tools(req.tools),
            req.chat_template_kwargs,
        )["prompt"]
        special = bool(req.add_special_tokens)
    else:
        text, special = req.prompt, req.add_special_tokens is not False
    ids = tokenizer.encode(text, add_special_tokens=special)
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize(req: DetokenizeRequest, engine, vocab_size: int) -> dict:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidParameter("tokens", "detokenizing needs the model's tokenizer (skip_tokenizer_init is set)")
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter("tokens", f"token id {bad} is out of vocabulary (ids are in [0, {vocab_size}))")
    return {"prompt": tokenizer.decode(req.tokens)}
