"""`pagedllm serve --data-parallel-size N`: N engine replicas on Ray Serve behind one endpoint.

Ray starts here (a one-machine cluster) unless RAY_ADDRESS names a running one, whose nodes
then hold the replicas. SIGTERM or Ctrl-C stops the application: Ray Serve lets each replica
finish its requests for up to --shutdown-timeout seconds, then the engines stop."""

from __future__ import annotations

import logging
import os
import signal
import threading

from ..serve import ServeOptions, served_model_name

logger = logging.getLogger("pagedllm.entrypoints")
APP = "pagedllm"


def run_replicas(engine_kwargs: dict, options: ServeOptions, num_replicas: int) -> None:
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(f"--data-parallel-size needs Ray Serve: pip install 'pagedllm[ray]' ({e})") from None
    from .deployment import build_app

    options.check()
    name = served_model_name(engine_kwargs.get("model"), options.model_name)
    quiet = {"log_level": "WARNING"}
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up lines; the banner says it
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.ERROR)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": options.host, "port": options.port}, logging_config=quiet)
        app = build_app(engine_kwargs, num_replicas=num_replicas, options=options)
        serve.run(app, name=APP, route_prefix="/", logging_config=quiet)
        where = f"http://{options.host}:{options.port}"
        print(
            f"pagedllm: serving {name!r} on {where} ({num_replicas} replicas on Ray Serve) [pid {os.getpid()}]",
            flush=True,
        )
        stop.wait()
        logger.warning("shutting down: the replicas finish their requests (at most %.0f s)", options.shutdown_timeout)
    finally:
        # a Ctrl-C in a terminal also stops Ray's own processes (they share its process group),
        # and then Serve's shutdown would wait for them forever
        stopping = threading.Thread(target=serve.shutdown, daemon=True)
        stopping.start()
        stopping.join(options.shutdown_timeout + 15)
        ray.shutdown()
