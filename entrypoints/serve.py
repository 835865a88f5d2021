"""`pagedllm serve`: one engine behind the OpenAI HTTP API (uvicorn) and the ZMQ entrypoint,
both on one asyncio loop in this process.

SIGTERM (what systemd, Docker and Kubernetes send) or Ctrl-C drains the server: it stops
taking requests (it still listens: new HTTP requests get 503, ZMQ ones an error with code 503,
and /health says 503), lets the running ones finish for up to `shutdown_timeout` seconds,
aborts the rest (their clients get finish_reason "abort"), stops the engine and exits 0. A
second signal aborts at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

import uvicorn

from .async_engine import AsyncEngine
from .chat_output import ChatOptions
from .limits import ServerLimits
from .metrics import EngineMetrics
from .openai_server import OpenAIServer
from .zmq_auth import ServerCurve, check_endpoint_security
from .zmq_server import ZmqServer

logger = logging.getLogger("pagedllm.entrypoints")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_endpoint: str | None = "tcp://127.0.0.1:5555"
    api_key: str | None = None
    model_name: str | None = None  # default: the model as given, or "pagedllm-demo"
    max_queue_len: int | None = None
    log_level: str = "warning"
    shutdown_timeout: float = 30.0
    zmq_curve: ServerCurve | None = None
    zmq_allow_insecure: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    enable_server_load_tracking: bool = False  # GET /load counts the requests being answered
    enable_force_include_usage: bool = False  # usage on every streamed chunk
    return_tokens_as_token_ids: bool = False  # logprobs name tokens `token_id:N`
    chat: ChatOptions = field(default_factory=ChatOptions)  # template, tool-call and reasoning parsers
    lora_modules: list[str] = field(default_factory=list)  # name=path: LoRA adapters a request's `model` names

    def check(self) -> None:
        """Refusals that need no engine: run before one starts."""
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout: must be >= 0, got {self.shutdown_timeout}")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"--max-queue-len: must be >= 0, got {self.max_queue_len}")
        self.chat.check()
        if self.zmq_endpoint:
            check_endpoint_security(self.zmq_endpoint, self.zmq_curve, self.zmq_allow_insecure)


def served_model_name(model: str | None, given: str | None) -> str:
    return given or model or "pagedllm-demo"


def openai_server(engine: AsyncEngine, name: str, options: ServeOptions, metrics: EngineMetrics, checks=()):
    """The OpenAI HTTP API over `engine`, as `options` set it up (one server, or one replica)."""
    return OpenAIServer(
        engine,
        name,
        options.api_key,
        metrics,
        options.limits,
        checks,
        track_load=options.enable_server_load_tracking,
        force_usage=options.enable_force_include_usage,
        tokens_as_ids=options.return_tokens_as_token_ids,
        chat=options.chat,
        lora_modules=options.lora_modules,
    )


def prepare_options(engine_kwargs: dict, options: ServeOptions) -> str:
    """Checks the options against the engine's arguments; the served model's name."""
    options.check()
    # n and beam widths beyond the sequence cap could never run
    options.limits.max_n = min(options.limits.max_n, engine_kwargs.get("max_num_seqs", 256))
    return served_model_name(engine_kwargs.get("model"), options.model_name)


def run_server(engine_kwargs: dict, options: ServeOptions) -> None:
    name = prepare_options(engine_kwargs, options)
    metrics = EngineMetrics(name)
    engine = AsyncEngine(max_queue_len=options.max_queue_len, metrics=metrics, **engine_kwargs)
    main = _serve(engine, name, options, metrics)
    try:
        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(main)
        else:  # no loop factories before 3.11: the default loop
            asyncio.run(main)
    finally:
        engine.shutdown()


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the drain below owns SIGTERM and SIGINT
    (uvicorn re-raises a caught SIGTERM after stopping, which killed the process with 143)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _serve(engine: AsyncEngine, name: str, options: ServeOptions, metrics: EngineMetrics) -> None:
    zmq_server = None
    if options.zmq_endpoint:
        zmq_server = ZmqServer(engine, options.zmq_endpoint, name, options.zmq_curve, options.limits)
    checks = [lambda: None if engine.accepting else "shutting down: finishing the running requests"]
    if zmq_server is not None:
        checks.append(lambda: zmq_server.dead_reason)
    app = openai_server(engine, name, options, metrics, checks).app
    server = _Server(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            lifespan="off",
            # the drain aborts what is left at shutdown_timeout; the aborted streams then end
            timeout_graceful_shutdown=options.shutdown_timeout + 10,
            access_log=False,
        )
    )
    zmq_task = asyncio.create_task(zmq_server.serve()) if zmq_server else None
    drain = _Drain(engine, server, zmq_server, options.shutdown_timeout)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.signal)
    where = f"http://{options.host}:{options.port}" + (f" and {zmq_server.endpoint} (ZMQ)" if zmq_server else "")

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"pagedllm: serving {name!r} on {where} [pid {os.getpid()}]", flush=True)

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
        await drain.finished()
    finally:
        announcer.cancel()
        if zmq_task is not None:
            zmq_task.cancel()
            try:
                await zmq_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
            zmq_server.close()
    if not server.started:
        logger.error("could not serve on %s:%d (see above)", options.host, options.port)
        raise SystemExit(1)


class _Drain:
    """Stop taking requests; wait for the open ones up to the timeout, then abort them."""

    def __init__(self, engine: AsyncEngine, server: uvicorn.Server, zmq_server: ZmqServer | None, timeout_s: float):
        self.engine, self.server, self.zmq_server, self.timeout_s = engine, server, zmq_server, timeout_s
        self.task: asyncio.Task | None = None

    def signal(self) -> None:
        if self.task is not None:  # a second signal: do not wait any longer
            self.engine.abort_all()
            return
        logger.warning("shutting down: finishing the running requests (at most %.0f s)", self.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        self.engine.stop_accepting()  # new requests are answered 503 while the others finish
        clock = asyncio.get_running_loop().time
        deadline = clock() + self.timeout_s
        while self.engine.num_open_requests and clock() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_open_requests:
            logger.warning("aborting %d requests still running", self.engine.num_open_requests)
            self.engine.abort_all()
        deadline = clock() + 10
        while self.zmq_server is not None and self.zmq_server.tasks and clock() < deadline:
            await asyncio.sleep(0.05)  # the aborted requests' finals go out
        self.server.should_exit = True  # uvicorn stops listening and waits for open responses

    async def finished(self) -> None:
        if self.task is not None:
            await self.task
