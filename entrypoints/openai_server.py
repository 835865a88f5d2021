"""The OpenAI-compatible HTTP API on starlette (run by uvicorn): /v1/completions,
/v1/chat/completions, /v1/responses (streamed as server-sent events when asked),
/v1/embeddings, /v1/models, /version, /health and /metrics, and vLLM's /tokenize,
/detokenize, /invocations and /load. A client that goes away has its requests aborted, which
frees their blocks. No request can fail the server: an error is a JSON error body naming the
field, and an unexpected one is logged here and answered with a 500 that carries no traceback."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedllm.core.errors import InvalidParameter, RequestFailed
from pagedllm.core.model_folder import model_folder
from pagedllm.core.version import VERSION

from .async_engine import AsyncEngine, EngineOverloaded, EngineShuttingDown, RequestStream
from .chat_output import RESERVED_TEMPLATE_KWARGS, ChatOptions, ChatOutputParser, reasoning_end_token
from .engine_client import EngineDeadError
from .limits import RequestTooLarge, ServerLimits
from .metrics import CONTENT_TYPE, EngineMetrics
from .openai_embeddings import EmbeddingRequest, embedding_body, output_size
from .openai_lora import ADMIN_BODY_BYTES, LoadLoRAAdapter, ServedAdapters, UnloadLoRAAdapter, runtime_updating
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    error_body,
    invocation_kind,
    new_id,
    now,
)
from .openai_responses import ChatResponses, CompletionResponses
from .openai_tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .reasoning_parsers import constraint_gate
from .responses_api import ResponsesAnswers, ResponsesRequest
from .tool_parsers import KEEPS_SPECIAL_TOKENS

logger = logging.getLogger("pagedllm.entrypoints")
CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer: nobody reads it


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def failure_parts(error: Exception) -> tuple[str, str, str | None, str | None]:
    """(message, type, param, code) of an error a request met in the engine."""
    if isinstance(error, InvalidParameter):
        return str(error), "invalid_request_error", error.field, None
    if isinstance(error, RequestFailed):
        return str(error), "server_error", None, "request_failed"
    return str(error), "server_error", None, "engine_dead"


def failure_response(error: Exception) -> JSONResponse:
    status = 400 if isinstance(error, InvalidParameter) else 500
    return error_response(status, *failure_parts(error))


class EventStream(Response):
    """Server-sent events from an async iterator of JSON-able chunks, ending with [DONE]. Watches
    for the client's disconnect and then stops the iterator (which aborts the requests)."""

    def __init__(self, chunks, on_close=None):
        self.status_code = 200
        self.background = None
        self.on_close = on_close  # called once the stream ended, however it ended
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
                    await send({"type": "http.response.body", "body": sse_event(chunk), "more_body": True})
            except (InvalidParameter, RequestFailed, EngineDeadError) as e:  # once the stream had started
                error = error_body(*failure_parts(e))
                await send({"type": "http.response.body", "body": sse_event(error), "more_body": True})
            except Exception:
                logger.exception("a streamed response failed")
                error = error_body("internal error (the server log has why)", "server_error", None, "internal_error")
                await send({"type": "http.response.body", "body": sse_event(error), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            await self.chunks.aclose()
            if self.on_close is not None:
                self.on_close()


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(obj) -> bytes:
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


ADMISSION_ERRORS = (ClientDisconnect, RequestTooLarge, InvalidParameter, EngineOverloaded, EngineDeadError)
ENGINE_INPUT_FIELDS = ("prompt", "prompts", "prompt_token_ids")


def _refusal(error: Exception, streams: list[RequestStream], rename=lambda e: e) -> Response:
    """The answer to a request refused before its response began; the streams it had opened
    are closed. `rename(e)`: an InvalidParameter naming the field as the client sent it."""
    for stream in streams:
        stream.close()
    if isinstance(error, ClientDisconnect):  # it left while sending the body: nobody to answer
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(error, RequestTooLarge):
        return error_response(413, str(error), "invalid_request_error", code="request_too_large")
    if isinstance(error, InvalidParameter):
        error = rename(error)
        return error_response(400, str(error), "invalid_request_error", error.field)
    if isinstance(error, EngineOverloaded):
        code = "shutting_down" if isinstance(error, EngineShuttingDown) else "overloaded"
        return error_response(503, str(error), "server_error", code=code)
    return error_response(500, str(error), "server_error", code="engine_dead")


def _not_json(request: Request) -> Response | None:
    """A 415 for a body that does not say it is JSON."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type == "application/json":
        return None
    return error_response(
        415,
        f"the body must be JSON (Content-Type: application/json), got {media_type or 'no Content-Type'!r}",
        "invalid_request_error",
        code="unsupported_media_type",
    )


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
        health_checks=(),
        track_load: bool = False,
        force_usage: bool = False,
        tokens_as_ids: bool = False,
        chat: ChatOptions | None = None,
        lora_modules: list[str] = (),
    ):
        """health_checks: callables that return why the server is unhealthy, or None (e.g. a
        ZMQ entrypoint beside it that stopped). track_load: count the completions and chat
        requests being answered, for GET /load (vLLM's --enable-server-load-tracking).
        force_usage: usage on every streamed chunk, asked for or not (--enable-force-include-usage).
        tokens_as_ids: logprobs name tokens `token_id:N` unless a request says otherwise
        (--return-tokens-as-token-ids). chat: the chat template, tool-call and reasoning parsers."""
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.health_checks = list(health_checks)
        self.track_load, self.server_load = track_load, 0
        self.force_usage, self.tokens_as_ids = force_usage, tokens_as_ids
        self.chat = chat or ChatOptions()
        self.chat_template = self.chat.template()
        self.tool_format, self.reasoning = self.chat.tool_format, self.chat.reasoning_format
        self.reasoning_end = reasoning_end_token(engine.tokenizer, self.reasoning) if self.reasoning else None
        self.adapters = ServedAdapters(engine, model_name, list(lora_modules))
        runtime = []
        if runtime_updating():
            runtime = [
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            ]
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/load", self.load, methods=["GET"]),
                Route("/invocations", self.invocations, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                *runtime,
            ]
        )
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)
        self.app.add_exception_handler(Exception, self._internal_error)

    # --- plain routes -----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        reason = self.engine.dead_reason
        if reason is not None:
            return Response(reason, status_code=503)
        if self.engine.recovering is not None:  # requests pause meanwhile; none fails
            return Response(f"recovering: {self.engine.recovering}", status_code=503)
        for check in self.health_checks:
            problem = check()
            if problem is not None:
                return Response(problem, status_code=503)
        return Response(status_code=200)

    async def render_metrics(self, request: Request) -> Response:
        if self.metrics is None:
            return Response("metrics are off", status_code=404)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def load(self, request: Request) -> Response:
        """Requests being answered (0 unless --enable-server-load-tracking), as vLLM's /load."""
        return JSONResponse({"server_load": self.server_load})

    async def version(self, request: Request) -> Response:
        ready = self.engine.engine.ready  # what the backend declares, as the engine started it
        return JSONResponse({"version": VERSION, "backend": ready.backend, "batch_invariant": ready.batch_invariant})

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
                    },
                    *self.adapters.cards(now(), self.engine.max_model_len),
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

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal error (the server log has why)", "server_error", code="internal_error")

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
        return await self._counted(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(request, ChatCompletionRequest)

    async def responses(self, request: Request) -> Response:
        return await self._counted(request, ResponsesRequest)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's entry (as vLLM's): a body with `messages` is a chat completion, one with
        `prompt` a completion, one with `input` an embedding."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await read_body(request, self.limits)
            kind = invocation_kind(body)
            if kind is EmbeddingRequest:
                return await self._embed(request, body)
        except (ClientDisconnect, RequestTooLarge, InvalidParameter) as e:
            return _refusal(e, [])
        return await self._counted(request, kind, body)

    async def _counted(self, request: Request, kind, body: bytes | None = None) -> Response:
        """_generate, counted in server_load (with load tracking) until its answer has gone."""
        if not self.track_load:
            return await self._generate(request, kind, body)
        self.server_load += 1
        try:
            response = await self._generate(request, kind, body)
        except BaseException:
            self.server_load -= 1
            raise
        if isinstance(response, EventStream):
            response.on_close = self._unload
        else:
            self._unload()
        return response

    def _unload(self) -> None:
        self.server_load -= 1

    async def _generate(self, request: Request, kind, body: bytes | None = None) -> Response:
        """body: already read (/invocations), or None to read it here."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if (refused := _not_json(request)) is not None:
            return refused
        responses_api = kind is ResponsesRequest  # run as the chat completion it asks for
        is_chat = kind is ChatCompletionRequest or responses_api
        streams: list[RequestStream] = []
        req = None
        try:
            decoded = decode_body(body if body is not None else await read_body(request, self.limits), kind)
            req = decoded.to_chat() if responses_api else decoded
            if is_chat:
                self._choose_tools(req)
            if (unknown := self._unknown_model(req)) is not None:
                return unknown
            params = req.to_sampling_params()
            self.limits.check(params, req.wire_field)
            prompts = self._prompts(req, is_chat)
            self.limits.check_prompts(len(prompts))
            prepared = [self.engine.prepare(p, req.truncation) for p in prompts]
            lens = [len(p["prompt_token_ids"]) for p in prepared]
            params = self.engine.logprobs_asked(params)
            self.limits.check_logprob_entries(params, lens, self.engine.max_model_len, req.wire_field)
            gate, parser = None, None
            if is_chat:
                params, gate, parser = self._chat_parsing(req, params, prepared[0]["prompt"])
            lora = self.adapters.of(req.model)
            for prompt in prepared:
                streams.append(self.engine.add_request(prompt, params, structured_outputs_after=gate, lora=lora))
        except ADMISSION_ERRORS as e:
            return _refusal(e, streams, lambda e: e.renamed(req.wire_field(e.field)) if req is not None else e)
        if responses_api:
            answers = ResponsesAnswers(decoded, req, parser, self.model_name, self.reasoning_end)
            if req.stream:
                return EventStream(answers.events(merged(streams)))
            outputs = await self._outputs(request, streams, req.wire_field)
            return outputs if isinstance(outputs, Response) else JSONResponse(answers.body(outputs[0]))
        model = req.model if lora is not None else self.model_name  # an adapter answers under its name
        meta = {"id": new_id("chatcmpl" if is_chat else "cmpl"), "created": now(), "model": model}
        if is_chat:
            responses = ChatResponses(req, params, meta, self.force_usage, self.tokens_as_ids, parser)
        else:
            responses = CompletionResponses(
                req, params, meta, self.engine.tokenizer, self.force_usage, self.tokens_as_ids
            )
        if req.stream:
            updates = merged(streams)
            first = streams[0].tracker.output.prompt_token_ids
            return EventStream(responses.chunks(updates, first) if is_chat else responses.chunks(updates, len(streams)))
        outputs = await self._outputs(request, streams, req.wire_field)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(responses.body(outputs))

    async def _outputs(self, request: Request, streams: list[RequestStream], wire_field=lambda f: f):
        """The requests' final outputs, or the Response to give instead: none (499) where the
        client left first (its requests are aborted), an error where the engine refused or
        failed one (`wire_field` names a refused field as the client sent it)."""
        work = asyncio.ensure_future(self._collect(streams))
        watcher = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not work.done():  # the client left: stop (which aborts the requests), answer nobody
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=CLIENT_CLOSED)
        try:
            return work.result()
        except (InvalidParameter, RequestFailed, EngineDeadError) as e:  # refused or failed in the engine core
            if isinstance(e, InvalidParameter):
                e = e.renamed(wire_field(e.field))
            return failure_response(e)

    def _unknown_model(self, req, adapters: bool = True) -> Response | None:
        """A 404 for a `model` this server does not serve (adapters: its LoRA adapters count)."""
        if req.model is None or req.model == self.model_name or (adapters and self.adapters.of(req.model)):
            return None
        return error_response(
            404,
            f"the model {req.model!r} does not exist; this server has {self.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    # --- embeddings -------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        if (refused := _not_json(request)) is not None:
            return refused
        return await self._embed(request)

    async def _embed(self, request: Request, body: bytes | None = None) -> Response:
        streams: list[RequestStream] = []
        try:
            req = decode_body(body if body is not None else await read_body(request, self.limits), EmbeddingRequest)
            if (unknown := self._unknown_model(req, adapters=False)) is not None:  # adapters generate
                return unknown
            params = self.engine.inputs.embedding_params()
            config = model_folder(self.engine.engine.config.model).config  # read once: model_folder caches
            matryoshka = config.get("matryoshka_dimensions") or bool(config.get("is_matryoshka"))
            size = output_size(req, config.get("hidden_size"), matryoshka)
            prompts = req.prompts()
            self.limits.check_prompts(len(prompts))
            prepared = [self.engine.prepare(p, req.truncation) for p in prompts]
            longest = self.engine.max_model_len - 1  # the engine keeps room for a token after a prompt
            for i, prompt in enumerate(prepared):
                if len(prompt["prompt_token_ids"]) > longest:
                    raise InvalidParameter(
                        "input",
                        f"input {i} has {len(prompt['prompt_token_ids'])} tokens; at most {longest} fit this "
                        "model's context (truncate_prompt_tokens keeps the last ones)",
                    )
            for prompt in prepared:
                streams.append(self.engine.add_request(prompt, params))
        except ADMISSION_ERRORS as e:  # the engine's names for the input are the body's `input`
            return _refusal(e, streams, lambda e: e.renamed("input") if e.field in ENGINE_INPUT_FIELDS else e)
        outputs = await self._outputs(request, streams)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(embedding_body(req, outputs, self.model_name, size, params.pooling.normalize))

    # --- routes answered without the engine's steps ------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        def render(conv, add_generation_prompt, continue_final_message, tools, kwargs):
            self._check_template_kwargs(kwargs)
            return self.engine.render_chat(
                conv, self.chat_template, add_generation_prompt, continue_final_message, tools, kwargs
            )

        return await self._answer_now(
            request, TokenizeRequest, lambda req: tokenize(req, self.engine, render, self.engine.max_model_len)
        )

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's: the tokenizer's special tokens and chat template, for clients that tokenize
        as the server does (lm-evaluation-harness's remote tokenizer); on with
        --enable-tokenizer-info-endpoint, as vLLM's."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if not self.chat.tokenizer_info or self.engine.tokenizer is None:
            return await self._not_found(request, None)
        tok = self.engine.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": type(tok).__name__,
                "eos_token": tok.eos_token,
                "bos_token": tok.bos_token,
                "pad_token": tok.pad_token,
                "unk_token": tok.unk_token,
                "chat_template": self.chat_template or getattr(tok, "chat_template", None),
                "model_max_length": self.engine.max_model_len,
                "vocab_size": self.engine.inputs.vocab_size,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        vocab_size = self.engine.inputs.vocab_size
        return await self._answer_now(request, DetokenizeRequest, lambda req: detokenize(req, self.engine, vocab_size))

    async def _answer_now(self, request: Request, kind, answer) -> Response:
        """A JSON body of `kind` answered by `answer(req)` (a dict), with the API key, media type,
        size and model checks of every route, and a 400 naming the field of a bad one."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if (refused := _not_json(request)) is not None:
            return refused
        try:
            req = decode_body(await read_body(request, self.limits), kind)
            if (unknown := self._unknown_model(req)) is not None:
                return unknown
            return JSONResponse(answer(req))
        except (ClientDisconnect, RequestTooLarge, InvalidParameter) as e:
            return _refusal(e, [])

    # --- LoRA adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING) ----------------------------
    async def load_lora_adapter(self, request: Request) -> Response:
        return await self._adapter_change(request, LoadLoRAAdapter, self.adapters.load)

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._adapter_change(request, UnloadLoRAAdapter, self.adapters.unload)

    async def _adapter_change(self, request: Request, kind, change) -> Response:
        """The API key, media type and body checks of every route (a body of at most
        ADMIN_BODY_BYTES), then `change(req)`: its plain-text answer, as vLLM's."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if (refused := _not_json(request)) is not None:
            return refused
        limits = dataclasses.replace(
            self.limits, max_request_bytes=min(self.limits.max_request_bytes, ADMIN_BODY_BYTES)
        )
        try:
            return change(decode_body(await read_body(request, limits), kind))
        except (ClientDisconnect, RequestTooLarge, InvalidParameter) as e:
            return _refusal(e, [])

    @staticmethod
    def _check_template_kwargs(kwargs: dict | None) -> None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise InvalidParameter("chat_template_kwargs", f"{reserved[0]!r} is not a template variable")

    def _prompts(self, req, is_chat: bool) -> list:
        if is_chat:
            self._check_template_kwargs(req.chat_template_kwargs)
            return [
                self.engine.render_chat(
                    req.conversation(),
                    self.chat_template,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    tools=req.template_tools(),
                    template_kwargs=req.chat_template_kwargs,
                )
            ]
        return req.prompts()

    def _choose_tools(self, req) -> None:
        """tool_choice: "auto" where tools are given and none is chosen, if this server reads
        automatic calls (vLLM's rule); "auto" refused where it does not."""
        if req.tool_choice is None and req.tools and self.tool_format is not None:
            req.tool_choice = "auto"
        if req.tool_choice == "auto" and self.tool_format is None:
            raise InvalidParameter(
                "tool_choice", '"auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser'
            )

    def _chat_parsing(self, req, params, prompt: str):
        """(the params, the token that opens the grammar, a maker of each choice's
        ChatOutputParser): what the tool-call and reasoning parsers change in a chat request."""
        tools = self.tool_format if req.tool_choice == "auto" else None
        if tools is not None and tools.name in KEEPS_SPECIAL_TOKENS:  # their markers are special tokens
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        gate = None
        if self.reasoning is not None and params.structured_outputs is not None:
            gate = constraint_gate(self.reasoning, prompt, self.reasoning_end)
        if tools is None and self.reasoning is None:
            return params, gate, None
        return (
            params,
            gate,
            functools.partial(
                ChatOutputParser, self.reasoning, prompt, tools, req.include_reasoning, req.parallel_tool_calls
            ),
        )

    @staticmethod
    async def _collect(streams: list[RequestStream]):
        last = [None] * len(streams)
        async for i, out in merged(streams):
            last[i] = out.output
        return last
