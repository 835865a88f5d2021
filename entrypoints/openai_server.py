"""The OpenAI-compatible HTTP API on starlette (run by uvicorn): /v1/completions,
/v1/chat/completions (streamed as server-sent events when asked), /v1/models, /health and
/metrics. A client that goes away has its requests aborted, which frees their blocks."""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedllm.core.errors import InvalidParameter

from .async_engine import AsyncEngine, EngineOverloaded, RequestStream
from .engine_client import EngineDeadError
from .limits import RequestTooLarge, ServerLimits
from .metrics import CONTENT_TYPE, EngineMetrics
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    decode_body,
    error_body,
    new_id,
    now,
    usage,
)


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


class EventStream(Response):
    """Server-sent events from an async iterator of JSON-able chunks, ending with [DONE]. Watches
    for the client's disconnect and then stops the iterator (which aborts the requests)."""

    def __init__(self, chunks):
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        producer = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            producer.cancel()

        watcher = asyncio.create_task(watch())
        try:
            try:
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            except InvalidParameter as e:  # refused by the engine core once the stream had started
                error = error_body(str(e), "invalid_request_error", e.field, None)
                await send({"type": "http.response.body", "body": _event(error), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            await self.chunks.aclose()


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _event(obj) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


async def merged(streams: list[RequestStream]):
    """(stream index, StreamOutput) from several request streams as they come; closes them all."""
    if len(streams) == 1:  # the common case: no extra task and queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The body, refused (RequestTooLarge) as soon as it is known to exceed the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        limits.check_size(int(declared), "request body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        limits.check_size(size, "request body")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        api_key: str | None = None,
        metrics: EngineMetrics | None = None,
        limits: ServerLimits | None = None,
    ):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ]
        )
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)

    # --- plain routes -----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        reason = self.engine.dead_reason
        if reason is not None:
            return Response(reason, status_code=503)
        if self.engine.recovering is not None:  # requests pause meanwhile; none fails
            return Response(f"recovering: {self.engine.recovering}", status_code=503)
        return Response(status_code=200)

    async def render_metrics(self, request: Request) -> Response:
        if self.metrics is None:
            return Response("metrics are off", status_code=404)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": now(),
                        "owned_by": "pagedllm",
                        "max_model_len": self.engine.max_model_len,
                    }
                ],
            }
        )

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(404, f"no route {request.url.path}", "invalid_request_error", code="not_found")

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(
            405,
            f"{request.method} is not allowed on {request.url.path}",
            "invalid_request_error",
            code="method_not_allowed",
        )

    def _check_key(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):  # constant time
            return error_response(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY')",
                "invalid_request_error",
                code="invalid_api_key",
            )
        return None

    # --- generation -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(
            request, CompletionRequest, self._completion_prompts, self._completion_body, self._completion_chunks
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(
            request, ChatCompletionRequest, self._chat_prompts, self._chat_body, self._chat_chunks
        )

    async def _generate(self, request: Request, kind, prompts_of, body_of, chunks_of) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        streams: list[RequestStream] = []
        try:
            req = decode_body(await read_body(request, self.limits), kind)
            if req.model is not None and req.model != self.model_name:
                return error_response(
                    404,
                    f"the model {req.model!r} does not exist; this server has {self.model_name!r}",
                    "invalid_request_error",
                    "model",
                    "model_not_found",
                )
            params = req.to_sampling_params()
            is_chat = kind is ChatCompletionRequest
            self.limits.check(params, logprobs_field="top_logprobs" if is_chat else "logprobs")
            prompts = prompts_of(req)
            self.limits.check_prompts(len(prompts))
            for prompt in prompts:
                streams.append(self.engine.add_request(prompt, params))
        except RequestTooLarge as e:
            return error_response(413, str(e), "invalid_request_error", code="request_too_large")
        except InvalidParameter as e:
            for s in streams:
                s.close()
            return error_response(400, str(e), "invalid_request_error", e.field)
        except EngineOverloaded as e:
            for s in streams:
                s.close()
            return error_response(503, str(e), "server_error", code="overloaded")
        except EngineDeadError as e:
            return error_response(500, str(e), "server_error", code="engine_dead")
        meta = {
            "id": new_id("chatcmpl" if kind is ChatCompletionRequest else "cmpl"),
            "created": now(),
            "model": self.model_name,
        }
        if req.stream:
            return EventStream(chunks_of(req, params, streams, meta))
        # not streamed: wait for the end, unless the client leaves first
        work = asyncio.ensure_future(self._collect(streams))
        watcher = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not work.done():  # the client left: stop (which aborts the requests), answer nobody
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        try:
            outputs = work.result()
        except InvalidParameter as e:  # refused by the engine core
            return error_response(400, str(e), "invalid_request_error", e.field)
        except EngineDeadError as e:
            return error_response(500, str(e), "server_error", code="engine_dead")
        return JSONResponse(body_of(req, params, outputs, meta))

    @staticmethod
    async def _collect(streams: list[RequestStream]):
        last = [None] * len(streams)
        async for i, out in merged(streams):
            last[i] = out.output
        return last

    # --- completions ------------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest) -> list:
        return req.prompts()

    def _completion_body(self, req: CompletionRequest, params, outputs, meta) -> dict:
        choices = []
        for p, out in enumerate(outputs):
            for comp in out.outputs:
                choices.append(
                    {
                        "index": p * params.n + comp.index,
                        "text": comp.text,
                        "logprobs": completion_logprobs(comp.logprobs, comp.token_ids, 0, req.logprobs)
                        if comp.logprobs is not None
                        else None,
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                )
        return {**meta, "object": "text_completion", "choices": choices, "usage": self._usage(outputs)}

    async def _completion_chunks(self, req: CompletionRequest, params, streams, meta):
        sent_lp = {}  # choice index -> logprob entries already sent
        offsets = {}
        last = [None] * len(streams)
        async for p, out in merged(streams):
            last[p] = out.output
            if not out.delta_text and out.finish_reason is None:
                continue
            index = p * params.n + out.index
            comp = out.output.outputs[out.index]
            logprobs = None
            if comp.logprobs is not None:
                start = sent_lp.get(index, 0)
                logprobs = completion_logprobs(
                    comp.logprobs[start:], comp.token_ids[start:], offsets.get(index, 0), req.logprobs
                )
                sent_lp[index] = len(comp.logprobs)
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            yield {
                **meta,
                "object": "text_completion",
                "choices": [
                    {"index": index, "text": out.delta_text, "logprobs": logprobs, "finish_reason": out.finish_reason}
                ],
            }
        if req.include_usage:
            yield {**meta, "object": "text_completion", "choices": [], "usage": self._usage(last)}

    # --- chat -------------------------------------------------------------------------------
    def _chat_prompts(self, req: ChatCompletionRequest) -> list:
        return [self.engine.render_chat(req.conversation(), add_generation_prompt=req.add_generation_prompt)]

    def _chat_body(self, req: ChatCompletionRequest, params, outputs, meta) -> dict:
        out = outputs[0]
        choices = [
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": chat_logprobs(comp.logprobs, comp.token_ids, req.top_logprobs or 0)
                if comp.logprobs is not None
                else None,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            for comp in out.outputs
        ]
        return {**meta, "object": "chat.completion", "choices": choices, "usage": self._usage(outputs)}

    async def _chat_chunks(self, req: ChatCompletionRequest, params, streams, meta):
        def chunk(index, delta, finish_reason=None, logprobs=None):
            return {
                **meta,
                "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            }

        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        sent_lp = {}
        last = None
        async for _, out in merged(streams):
            last = out.output
            if not out.delta_text and out.finish_reason is None:
                continue
            comp = out.output.outputs[out.index]
            logprobs = None
            if comp.logprobs is not None:
                start = sent_lp.get(out.index, 0)
                logprobs = chat_logprobs(comp.logprobs[start:], comp.token_ids[start:], req.top_logprobs or 0)
                sent_lp[out.index] = len(comp.logprobs)
            yield chunk(out.index, {"content": out.delta_text} if out.delta_text else {}, out.finish_reason, logprobs)
        if req.include_usage:
            yield {**meta, "object": "chat.completion.chunk", "choices": [], "usage": self._usage([last])}

    # --- shared -----------------------------------------------------------------------------
    @staticmethod
    def _usage(outputs) -> dict:
        outputs = [o for o in outputs if o is not None]
        return usage(
            sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)
        )
