"""`pagedllm serve`: one engine behind the OpenAI HTTP API (uvicorn) and the ZMQ entrypoint,
both on one asyncio loop in this process."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import uvicorn

from .async_engine import AsyncEngine
from .metrics import EngineMetrics
from .openai_server import OpenAIServer
from .zmq_server import ZmqServer

logger = logging.getLogger("pagedllm.entrypoints")


def served_model_name(model: str | None, given: str | None) -> str:
    if given:
        return given
    if model:
        return model
    return "pagedllm-demo"


def run_server(
    engine_kwargs: dict,
    host: str = "127.0.0.1",
    port: int = 8000,
    zmq_endpoint: str | None = "tcp://127.0.0.1:5555",
    api_key: str | None = None,
    model_name: str | None = None,
    max_queue_len: int | None = None,
    log_level: str = "warning",
) -> None:
    name = served_model_name(engine_kwargs.get("model"), model_name)
    metrics = EngineMetrics(name)
    engine = AsyncEngine(max_queue_len=max_queue_len, metrics=metrics, **engine_kwargs)
    main = _serve(engine, name, host, port, zmq_endpoint, api_key, metrics, log_level)
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


async def _serve(engine, name, host, port, zmq_endpoint, api_key, metrics, log_level) -> None:
    app = OpenAIServer(engine, name, api_key, metrics).app
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
            access_log=False,
        )
    )
    zmq_server = ZmqServer(engine, zmq_endpoint) if zmq_endpoint else None
    zmq_task = asyncio.create_task(zmq_server.serve()) if zmq_server else None
    where = f"http://{host}:{port}" + (f" and {zmq_server.endpoint} (ZMQ)" if zmq_server else "")

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"pagedllm: serving {name!r} on {where} [pid {os.getpid()}]", flush=True)

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
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
        logger.error("could not serve on %s:%d (see above)", host, port)
        raise SystemExit(1)
