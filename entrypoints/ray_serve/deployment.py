"""pagedllm's engine replicas on Ray Serve, behind one OpenAI-compatible endpoint.

    app = build_app({"model": "/models/llama"}, num_replicas=2)
    serve.run(app)                                    # or from `pagedllm serve --data-parallel-size 2`

Two deployments:

- `EngineReplica` (num_replicas of them): one engine each (its core and worker processes) and
  the same OpenAI server a `pagedllm serve` runs, called in process. Every route and every
  refusal is a single server's.
- `Ingress` (the HTTP entry): forwards each request, whole, to the replica the
  PrefixAwareRouter picks, and streams the answer back. It answers three routes itself from
  all replicas: /health (200 while any replica serves), /load (their sum) and /metrics
  (each replica's series with a `replica` label, as Ray labels its replicas' metrics); and it
  sends /v1/load_lora_adapter and /v1/unload_lora_adapter to every replica, the adapters
  loaded so to a replica that starts later (one Ray Serve put in place of a dead one) too.

A request whose replica dies before answering is sent to another one once (nothing reached the
client yet); a stream whose replica dies midway ends with an error event. Ray Serve replaces
the replica; the engine's processes of the dead one see their parent gone and exit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.backends.registry import device_count, resolve_alias

from ..async_engine import AsyncEngine
from ..metrics import CONTENT_TYPE, EngineMetrics
from ..openai_protocol import error_body
from ..openai_server import sse_event
from ..serve import ServeOptions, openai_server, prepare_options
from .registry import replica_ids
from .router import TARGETED, PrefixAwareRouter

logger = logging.getLogger("pagedllm.entrypoints")

REPLICA_FAILED = (RayActorError, ActorUnavailableError)  # the replica's process died or cannot be reached
ENGINES = "EngineReplica"  # the engines' deployment name: the ingress finds their router by it
MAX_ONGOING = 1024  # requests one replica takes at once (Ray's default, 5, would queue a batch in the router)
FANOUT_TIMEOUT_S = 5.0
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress received it; `prefix` is what the router matches."""

    method: str
    path: str
    query: bytes
    headers: list
    body: bytes
    prefix: str = ""


def routing_prefix(body: bytes) -> str:
    """The text of a completions, chat, responses or embeddings body that its prefix-cache
    blocks are made of, in order: the messages' roles and contents, or the (first) prompt."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    if isinstance(req.get("messages"), list):
        return "".join(f"{m.get('role')}:{_text(m.get('content'))}\n" for m in req["messages"] if isinstance(m, dict))
    prompt = req.get("prompt", req.get("input"))
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # several prompts: routed by the first
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) + ","  # token ids
    return _text(prompt)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text") if isinstance(part, dict) else part) for part in content)
    return ""


class EngineReplica:
    """One engine and its OpenAI server, answering forwarded requests in this process."""

    def __init__(self, engine_kwargs: dict, options: ServeOptions):
        name = prepare_options(engine_kwargs, options)
        self.metrics = EngineMetrics(name)
        self.engine = AsyncEngine(max_queue_len=options.max_queue_len, metrics=self.metrics, **engine_kwargs)
        self.server = openai_server(self.engine, name, options, self.metrics)

    async def forward(self, request: ForwardedRequest, **_):
        """Runs the server's ASGI app on `request`; yields (status, headers, first body part),
        then the further body parts. Cancelled (the client left): the app sees the disconnect,
        which aborts its requests."""
        sent: asyncio.Queue = asyncio.Queue()
        left = asyncio.Event()
        asked = False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": ("ray-serve-ingress", 0),
            "server": ("pagedllm-replica", 0),
        }
        app = asyncio.create_task(self.server.app(scope, receive, sent.put))
        app.add_done_callback(lambda _: sent.put_nowait(None))
        start = None
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    start = message
                elif message["type"] == "http.response.body":
                    part = message.get("body", b"")
                    if start is not None:  # the status goes out with the first part
                        yield start["status"], start.get("headers", []), part
                        start = None
                    elif part:
                        yield part
            if start is not None:
                yield start["status"], start.get("headers", []), b""
        finally:
            left.set()
            if not app.done():
                try:
                    await asyncio.wait_for(app, FANOUT_TIMEOUT_S)  # it aborts its requests and ends
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    app.cancel()

    async def answer(self, request: ForwardedRequest, **_) -> tuple[int, list, bytes]:
        """The whole answer to `request` (a short one, sent to every replica)."""
        parts = [part async for part in self.forward(request)]
        status, headers, first = parts[0]
        return status, headers, first + b"".join(parts[1:])

    async def status(self, **_) -> dict:
        return {
            "pid": os.getpid(),
            "problem": self.engine.dead_reason or (self.engine.recovering and f"recovering: {self.engine.recovering}"),
            "load": self.server.server_load,
        }

    async def metrics_text(self, **_) -> str:
        return self.metrics.render().decode()

    def check_health(self) -> None:
        """Ray Serve's health check: an engine that died makes Ray replace this replica."""
        if self.engine.dead_reason is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.dead_reason}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class Ingress:
    """The HTTP entry: forwards to the engine replicas (see the module's text)."""

    def __init__(self, engines, max_request_bytes: int):
        self.engines = engines
        self.max_request_bytes = max_request_bytes
        # adapters loaded at run time: their load requests by name (a replica that starts later
        # gets them), and the replicas that have them all
        self.adapters: dict[str, ForwardedRequest] = {}
        self.synced: set[str] = set()
        self.syncing = asyncio.Lock()

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path in ("/health", "/load", "/metrics"):
            return await getattr(self, path[1:])()
        received = bytearray()
        async for part in request.stream():
            received += part
            if len(received) > self.max_request_bytes:  # the replica refuses it, naming the limit
                break
        body = bytes(received)
        forwarded = ForwardedRequest(
            request.method, path, request.url.query.encode(), list(request.scope["headers"]), body, routing_prefix(body)
        )
        if request.method == "POST" and path in ADAPTER_ROUTES:
            return await self._change_adapters(forwarded)
        if self.adapters:
            await self._sync_new_replicas()
        for attempt in range(2):
            answer = self.engines.options(stream=True).forward.remote(forwarded)
            try:
                status, headers, first = await answer.__anext__()
            except asyncio.CancelledError:  # the client left before the answer began
                answer.cancel()
                raise
            except REPLICA_FAILED:
                logger.warning(
                    "a replica failed before answering %s %s%s",
                    request.method,
                    path,
                    "; sending it to another" if attempt == 0 else "",
                )
                continue
            except StopAsyncIteration:
                status, headers, first = 500, [], b""
            return ForwardedResponse(status, headers, first, answer)
        return JSONResponse(
            error_body("the replicas serving this request failed; try again", "server_error", None, "replica_failed"),
            status_code=503,
        )

    async def _change_adapters(self, forwarded: ForwardedRequest) -> Response:
        """A load or unload of an adapter, on every replica: the first success's answer (the
        change is then kept for replicas to come), else the first replica's."""
        await self._sync_new_replicas()
        async with self.syncing:
            answers = await self._each_replica("answer", forwarded)
            done = [a for _, a in answers if a is not None and a[0] == 200]
            if done:
                name = json.loads(forwarded.body)["lora_name"]  # the replicas read and checked it
                if forwarded.path == ADAPTER_ROUTES[0]:
                    self.adapters[name] = forwarded
                else:
                    self.adapters.pop(name, None)
                self.synced = {replica for replica, a in answers if a is not None}
        given = [a for _, a in answers if a is not None]
        if not given:
            return JSONResponse(error_body("no replica answered", "server_error", None), status_code=503)
        status, headers, body = (done or given)[0]
        answer = Response(body, status_code=status)
        answer.raw_headers = headers
        return answer

    async def _sync_new_replicas(self) -> None:
        """The adapters loaded at run time, loaded on each replica that started since."""
        if set(replica_ids(ENGINES)) <= self.synced:
            return
        async with self.syncing:
            ids = set(replica_ids(ENGINES))
            self.synced &= ids
            for replica in ids - self.synced:
                for load in self.adapters.values():
                    try:
                        call = self.engines.answer.remote(load, **{TARGETED: replica})
                        await asyncio.wait_for(call, FANOUT_TIMEOUT_S)
                    except (*REPLICA_FAILED, asyncio.TimeoutError):
                        logger.warning("replica %s did not take the adapters loaded at run time", replica)
                        break
                else:
                    self.synced.add(replica)

    async def _each_replica(self, method: str, *args) -> list:
        """`method`'s answer from every running replica (None where one did not answer)."""
        ids = replica_ids(ENGINES)
        if not ids:  # this process's router starts with its first call
            try:
                await asyncio.wait_for(self.engines.status.remote(), FANOUT_TIMEOUT_S)
            except (*REPLICA_FAILED, asyncio.TimeoutError):
                pass
            ids = replica_ids(ENGINES)

        answers = []
        for replica in ids:  # one at a time: Ray routes an ingress request's calls by its one request id
            try:
                call = getattr(self.engines, method).remote(*args, **{TARGETED: replica})
                answers.append((replica, await asyncio.wait_for(call, FANOUT_TIMEOUT_S)))
            except (*REPLICA_FAILED, asyncio.TimeoutError):
                answers.append((replica, None))
        return answers

    async def health(self) -> Response:
        answers = await self._each_replica("status")
        if any(a is not None and not a["problem"] for _, a in answers):
            return Response(status_code=200)
        problems = "; ".join(f"{r}: {a['problem'] if a else 'no answer'}" for r, a in answers)
        return Response(f"no replica serves ({problems or 'none running'})", status_code=503)

    async def load(self) -> Response:
        answers = await self._each_replica("status")
        return JSONResponse({"server_load": sum(a["load"] for _, a in answers if a is not None)})

    async def metrics(self) -> Response:
        answers = await self._each_replica("metrics_text")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Labelled([(r, text) for r, text in answers if text is not None]))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)


class _Labelled:
    """Several replicas' Prometheus texts as one, each series labelled with its replica."""

    def __init__(self, texts: list[tuple[str, str]]):
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in self.texts:
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


class ForwardedResponse(Response):
    """A replica's answer, streamed to the client as it comes."""

    def __init__(self, status: int, headers: list, first: bytes, rest):
        self.status_code, self.raw_headers, self.first, self.rest = status, headers, first, rest
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        try:
            if self.first:
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
            try:
                async for part in self.rest:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            except REPLICA_FAILED:
                logger.warning("a replica failed while it streamed an answer")
                if self._is_event_stream():
                    error = error_body(
                        "the replica serving this request failed", "server_error", None, "replica_failed"
                    )
                    await send({"type": "http.response.body", "body": sse_event(error), "more_body": True})
            ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not ended:  # the client left: the replica aborts what it runs for it
                self.rest.cancel()

    def _is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)


def build_app(
    engine_args: dict,
    *,
    num_replicas: int = 2,
    options: ServeOptions | None = None,
    routing: str = "prefix",
    replica_actor_options: dict | None = None,
    router_kwargs: dict | None = None,
):
    """A Ray Serve application: `num_replicas` engines (each `engine_args`, as `LLM` takes them)
    behind one ingress. `options`: the server's (API key, limits, chat parsers, ...; the ZMQ
    entrypoint is not used). `routing`: "prefix" (PrefixAwareRouter) or "round_robin".
    `replica_actor_options`: Ray's, per engine replica (default: default_actor_options)."""
    options = options or ServeOptions()
    if options.zmq_endpoint is not None:
        options = dataclasses.replace(options, zmq_endpoint=None)
    actor_options = replica_actor_options or default_actor_options(engine_args)
    engines = serve.deployment(
        EngineReplica,
        name=ENGINES,
        num_replicas=num_replicas,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options=actor_options,
        health_check_period_s=2,
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.25,  # how often a stopping replica looks for requests still running
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"policy": routing, **(router_kwargs or {})},
        ),
    ).bind(engine_args, options)
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.25,
    )
    return ingress.bind(engines, options.limits.max_request_bytes)


def default_actor_options(engine_args: dict) -> dict:
    """A CPU per tensor-parallel rank, or on a backend with devices (its platform counts them)
    one CPU and a GPU per rank."""
    backend, _ = resolve_alias(str(engine_args.get("backend") or "cpu"))
    ranks = engine_args.get("tensor_parallel_size", 1)
    if device_count(backend) is None:
        return {"num_cpus": ranks}
    return {"num_cpus": 1, "num_gpus": ranks}
