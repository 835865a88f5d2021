"""Logging for pagedllm's processes: one logger per package (`pagedllm.core`,
`pagedllm.backends`, `pagedllm.entrypoints`), to stderr, at the level of $PAGEDLLM_LOG_LEVEL
(default WARNING). The CLI's own user-facing lines are printed, not logged."""

from __future__ import annotations

import logging
import os

FORMAT = "%(name)s %(levelname)s: %(message)s"


def setup_logging() -> None:
    """Give the `pagedllm` loggers a stderr handler, once per process, unless the embedding
    application configured them already."""
    root = logging.getLogger("pagedllm")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PAGEDLLM_LOG_LEVEL", "WARNING").upper())
