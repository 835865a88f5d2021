"""Entry point of the engine-core process: `python -m pagedllm.core.process.engine_main ...`."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

from ..logs import setup_logging
from .local_workers import LocalWorkers


def main(argv=None) -> int:
    setup_logging()  # before the launcher starts: a launcher server's refusal is logged
    # the worker launcher imports torch, seconds: start it before this process's own imports
    launcher = LocalWorkers()
    import msgspec

    from ..config import EngineConfig
    from ..errors import EngineFailure
    from .engine import EngineCore

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--workers", required=True, help="where the workers reach the core (unless the config says)")
    args = ap.parse_args(argv)
    # Ctrl-C reaches the whole process group; the frontend decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through close()
    config = msgspec.json.decode(args.config, type=EngineConfig)
    core = EngineCore(config, args.input, args.output, args.workers, launcher)
    code = 0
    try:
        core.start()
        gc.freeze()  # what start-up made stays: collections in the loop walk only the new objects
        core.run()
    except EngineFailure as e:
        core.report_death(str(e))
        code = 1
    except Exception as e:  # report anything to the frontend before dying
        # the traceback goes to the log; the frontend (and its clients) get the one line
        logging.getLogger("pagedllm.core").exception("engine core crashed")
        core.report_death(f"engine core crashed: {e!r}")
        code = 1
    finally:
        core.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
