"""The bodies the OpenAI-compatible API answers with: whole responses and streamed chunks, for
completions (with echo and prompt logprobs) and chat, built from the frontend's RequestOutputs."""

from __future__ import annotations

from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
    usage,
)
from .openai_structured import tool_calls


def usage_of(outputs, echo_only: bool = False) -> dict:
    """Tokens over every prompt and completion so far; the prefix-cache hit as cached_tokens."""
    outputs = [o for o in outputs if o is not None]
    completion = 0 if echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage(sum(len(o.prompt_token_ids) for o in outputs), completion, sum(o.num_cached_tokens for o in outputs))


class _Options:
    """What the server's flags change in a response: which usage a stream carries (the final
    chunk's, include_usage, and every chunk's, continuous_usage_stats; --enable-force-include-usage
    turns both on) and how logprobs name tokens (`token_id:N` with return_tokens_as_token_ids,
    the request's or else --return-tokens-as-token-ids)."""

    def _options(self, req, force_usage: bool, tokens_as_ids: bool) -> None:
        self.include_usage = req.include_usage or force_usage
        self.continuous_usage = (req.continuous_usage and self.include_usage) or force_usage
        asked = req.return_tokens_as_token_ids
        self.as_ids = tokens_as_ids if asked is None else asked


class CompletionResponses(_Options):
    def __init__(
        self, req: CompletionRequest, params, meta: dict, tokenizer, force_usage: bool = False, tokens_as_ids=False
    ):
        self.req, self.params, self.meta, self.tokenizer = req, params, meta, tokenizer
        self._options(req, force_usage, tokens_as_ids)

    def _decode(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""

    def _prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _echoed(self, out, comp) -> tuple[str, list, list | None]:
        """(text, token ids, logprob entries) of a choice: the prompt's first when echoed."""
        req = self.req
        text, ids = comp.text, list(comp.token_ids)
        entries = list(comp.logprobs) if comp.logprobs is not None else None
        if req.echo_only:
            text, ids, entries = "", [], [] if entries is not None else None
        if req.echo:
            text = self._prompt_text(out) + text
            ids = list(out.prompt_token_ids) + ids
            if entries is not None:
                entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        return text, ids, entries

    def _extras(self, out, comp_ids: list[int], first: bool) -> dict:
        """token_ids and prompt_token_ids: null where not asked for, as vLLM's choices have them."""
        if not self.req.return_token_ids:
            return {"token_ids": None, "prompt_token_ids": None}
        return {"token_ids": comp_ids, "prompt_token_ids": list(out.prompt_token_ids) if first else None}

    def body(self, outputs: list) -> dict:
        req = self.req
        choices = []
        for p, out in enumerate(outputs):
            for comp in out.outputs:
                text, ids, entries = self._echoed(out, comp)
                logprobs = None
                if entries is not None and req.logprobs is not None:
                    logprobs = completion_logprobs(entries, ids, 0, req.logprobs, self._decode, self.as_ids)
                choices.append(
                    {
                        "index": p * self.params.n + comp.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": "length" if req.echo_only else comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                        "prompt_logprobs": prompt_logprobs_body(
                            out.prompt_logprobs if req.prompt_logprobs is not None else None
                        ),
                        **self._extras(out, comp.token_ids if not req.echo_only else [], True),
                    }
                )
        return {
            **self.meta,
            "object": "text_completion",
            "choices": choices,
            "usage": usage_of(outputs, req.echo_only),
        }

    async def chunks(self, updates, num_prompts: int):
        """Chunks from (prompt index, StreamOutput) updates. An echoed prompt comes first, once
        the prompt is computed (its logprobs complete). Each chunk carries the token ids and
        logprobs of its own updates (those that brought no text wait for the next chunk) and,
        with continuous usage, its choice's token count as of those updates."""
        req = self.req
        offsets, started = {}, set()
        pending: dict[int, tuple[list, list]] = {}  # choice index -> ids, logprob entries not yet sent
        last = [None] * num_prompts
        async for p, out in updates:
            last[p] = out.output
            index = p * self.params.n + out.index
            ids, entries = pending.setdefault(index, ([], []))
            ids += out.delta_token_ids
            entries += out.delta_logprobs or ()
            if index not in started and _prompt_done(out.output):
                started.add(index)
                first = self._first_chunk(out.output, index)
                offsets[index] = len(first["choices"][0]["text"])
                if self._carries_something(first):
                    yield self._with_usage(first, out, out.num_tokens - len(ids))
            if req.echo_only:
                if out.finish_reason is not None:
                    yield self._with_usage(self._chunk(index, "", None, "length", []), out, 0)
                continue
            if not out.delta_text and out.finish_reason is None:
                continue
            logprobs = None
            if out.output.outputs[out.index].logprobs is not None:
                logprobs = completion_logprobs(entries, ids, offsets.get(index, 0), req.logprobs, as_ids=self.as_ids)
                offsets[index] = offsets.get(index, 0) + sum(
                    len(e[t].decoded_token or "") for t, e in zip(ids, entries)
                )
            chunk = self._chunk(index, out.delta_text, logprobs, out.finish_reason, ids)
            del pending[index]
            yield self._with_usage(chunk, out, out.num_tokens)
        if self.include_usage:
            yield {**self.meta, "object": "text_completion", "choices": [], "usage": usage_of(last, req.echo_only)}

    def _carries_something(self, first: dict) -> bool:
        """Whether a choice's first chunk has anything of its own (an echoed prompt, prompt
        logprobs or token ids); an empty one is not sent (its first text comes next)."""
        choice = first["choices"][0]
        return bool(choice["text"] or choice["logprobs"] or "prompt_logprobs" in choice or "prompt_token_ids" in choice)

    def _first_chunk(self, out, index: int) -> dict:
        """Before a choice's first text: the echoed prompt, its prompt logprobs and token ids."""
        req = self.req
        text, logprobs = "", None
        if req.echo:
            text = self._prompt_text(out)
            if req.logprobs is not None:
                entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                logprobs = completion_logprobs(
                    entries, out.prompt_token_ids, 0, req.logprobs, self._decode, self.as_ids
                )
        chunk = self._chunk(index, text, logprobs, None, [])
        choice = chunk["choices"][0]
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return chunk

    def _chunk(self, index, text, logprobs, finish_reason, token_ids) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return {**self.meta, "object": "text_completion", "choices": [choice]}

    def _with_usage(self, chunk: dict, out, num_tokens: int) -> dict:
        """With continuous usage: the chunk's prompt and its choice's `num_tokens` (vLLM's)."""
        if self.continuous_usage:
            chunk["usage"] = usage(len(out.output.prompt_token_ids), num_tokens, out.output.num_cached_tokens)
        return chunk


def _prompt_done(output) -> bool:
    """Whether the prompt is computed, as far as the frontend can tell: its logprobs (when
    asked for) are all in, or a token came."""
    if output.prompt_logprobs is not None:
        return len(output.prompt_logprobs) >= len(output.prompt_token_ids)
    return any(c.token_ids or c.finish_reason for c in output.outputs)


class ChatResponses(_Options):
    def __init__(
        self,
        req: ChatCompletionRequest,
        params,
        meta: dict,
        force_usage: bool = False,
        tokens_as_ids=False,
        parser=None,
    ):
        """parser: makes a choice's ChatOutputParser (a reasoning or tool-call parser is on), or None."""
        self.req, self.params, self.meta = req, params, meta
        self._options(req, force_usage, tokens_as_ids)
        self.functions = req.forced_functions  # tool_choice required or named: the output is calls
        self.echoed = req.echoed  # echo: the text the answer starts with (the conversation's, read once)
        self.parser = parser

    def _message(self, comp) -> tuple[dict, str | None]:
        """The choice's message and finish_reason: its reasoning and content (split by the
        parser), and tool calls: read from the content by an automatic choice's parser, or from
        the constrained text of a forced one (which stays text where it was cut short)."""
        parts = self.parser().message(comp.text) if self.parser is not None else {"content": comp.text}
        reasoning = {"reasoning": parts["reasoning"]} if "reasoning" in parts else {}
        if self.functions is not None and comp.finish_reason == "stop":
            calls = tool_calls(parts["content"] or "", self.functions, self.req.tool_choice)
            if calls is not None:
                return {"role": "assistant", "content": None, **reasoning, "tool_calls": calls}, "tool_calls"
        if self.echoed:
            parts["content"] = self.echoed + (parts["content"] or "")
        called = "tool_calls" in parts and comp.finish_reason == "stop"
        return {"role": "assistant", **parts}, "tool_calls" if called else comp.finish_reason

    def body(self, outputs: list) -> dict:
        req = self.req
        out = outputs[0]
        choices = []
        for comp in out.outputs:
            message, finish_reason = self._message(comp)
            choice = {
                "index": comp.index,
                "message": message,
                "logprobs": chat_logprobs(comp.logprobs, comp.token_ids, req.top_logprobs or 0, self.as_ids)
                if comp.logprobs is not None
                else None,
                "finish_reason": finish_reason,
                "stop_reason": comp.stop_reason,
            }
            choice["token_ids"] = list(comp.token_ids) if req.return_token_ids else None  # null, as vLLM's
            choices.append(choice)
        return {
            **self.meta,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage_of(outputs),
            "prompt_logprobs": prompt_logprobs_body(out.prompt_logprobs if req.prompt_logprobs is not None else None),
            "prompt_token_ids": list(out.prompt_token_ids) if req.return_token_ids else None,
        }

    def _chunk(self, index, delta, finish_reason=None, logprobs=None, token_ids=None, out=None) -> dict:
        """`out`: the StreamOutput the chunk ends with, for continuous usage (its choice's count)."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        chunk = {**self.meta, "object": "chat.completion.chunk", "choices": [choice]}
        if self.continuous_usage and out is not None:
            chunk["usage"] = usage(len(out.output.prompt_token_ids), out.num_tokens, out.output.num_cached_tokens)
        return chunk

    async def chunks(self, updates, prompt_token_ids: list[int]):
        req = self.req
        ids = req.return_token_ids
        for i in range(self.params.n):
            chunk = self._chunk(i, {"role": "assistant", "content": ""}, token_ids=[] if ids else None)
            if ids and i == 0:
                chunk["prompt_token_ids"] = list(prompt_token_ids)
            if self.continuous_usage:
                chunk["usage"] = usage(len(prompt_token_ids), 0)
            yield chunk
        echoed = self.echoed if self.functions is None else ""
        for i in range(self.params.n if echoed else 0):  # echo: the last message's content first
            chunk = self._chunk(i, {"content": echoed})
            if self.continuous_usage:
                chunk["usage"] = usage(len(prompt_token_ids), 0)
            yield chunk
        pending: dict[int, tuple[list, list]] = {}  # choice -> ids, logprob entries not yet sent
        started: set[int] = set()  # choices whose forced call's first chunk went out
        last, prompt_lps_sent = None, False
        parsers: dict[int, object] = {}  # choice -> its ChatOutputParser
        async for _, out in updates:
            last = out.output
            new_ids, entries = pending.setdefault(out.index, ([], []))
            new_ids += out.delta_token_ids  # also those of updates without text, with the next chunk
            entries += out.delta_logprobs or ()
            deltas, finish_reason = self._deltas(parsers, out)
            if not deltas and finish_reason is None:
                continue
            del pending[out.index]
            logprobs = None
            if out.output.outputs[out.index].logprobs is not None:
                logprobs = chat_logprobs(entries, new_ids, req.top_logprobs or 0, self.as_ids)
            if self.functions is not None:  # a forced call: its arguments, as they come
                deltas = [self._tool_delta(d, out.index, started) if "content" in d else d for d in deltas]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            for k, delta in enumerate(deltas or [{}]):  # the tokens and logprobs go with the first
                first, final = k == 0, k == max(len(deltas), 1) - 1
                chunk = self._chunk(
                    out.index,
                    delta,
                    finish_reason if final else None,
                    logprobs if first else None,
                    (new_ids if first else []) if ids else None,
                    out,
                )
                if req.prompt_logprobs is not None and not prompt_lps_sent:
                    chunk["prompt_logprobs"] = prompt_logprobs_body(out.output.prompt_logprobs)
                    prompt_lps_sent = True
                yield chunk
        if self.include_usage:
            yield {**self.meta, "object": "chat.completion.chunk", "choices": [], "usage": usage_of([last])}

    def _deltas(self, parsers: dict, out) -> tuple[list[dict], str | None]:
        """The update's deltas and the choice's finish_reason ("tool_calls" where the parser
        read a call from an answer that stopped by itself)."""
        if self.parser is None:
            return ([{"content": out.delta_text}] if out.delta_text else []), out.finish_reason
        parser = parsers.get(out.index)
        if parser is None:
            parser = parsers[out.index] = self.parser()
        deltas = parser.feed(out.delta_text) if out.delta_text else []
        if out.finish_reason is None:
            return deltas, None
        deltas += parser.finish()
        return deltas, "tool_calls" if parser.called and out.finish_reason == "stop" else out.finish_reason

    def _tool_delta(self, delta: dict, index: int, started: set[int]) -> dict:
        """A streamed forced call's content: the call's id and name first, then its arguments."""
        call = {"index": 0, "function": {"arguments": delta["content"]}}
        if index not in started:
            started.add(index)
            call = {"index": 0, "id": f"call_{self.meta['id'][-24:]}_{index}", "type": "function"}
            call["function"] = {"name": self.functions[0].name, "arguments": delta["content"]}
        return {"tool_calls": [call]}
