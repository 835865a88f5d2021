"""The model used when none is given.

The package ships a small trained demo model (assets/demo-model, made by
tools/train_demo_model.py). If that folder is missing — a trimmed install — a tiny
random-weight Llama with a real tokenizer is made deterministically on first use and cached
instead: it runs everywhere, though its text is not meaningful.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

from pagedllm.core.cache_dir import cache_root

DEFAULT_MODEL_NAME = "pagedllm-tiny-random-llama-v1"


def shipped_model_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo-model")


def shipped_draft_dir() -> str:
    """The demo model's draft (speculative decoding): one layer, the same tokenizer."""
    return os.path.join(os.path.dirname(shipped_model_dir()), "demo-draft")


def default_model_dir() -> str:
    shipped = shipped_model_dir()
    if os.path.isfile(os.path.join(shipped, "config.json")):
        return shipped
    root = cache_root()
    path = os.path.join(root, DEFAULT_MODEL_NAME)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds it; the others wait
        if not os.path.isfile(os.path.join(path, "config.json")):
            from pagedllm.fixtures.tiny_models import make_model_dir

            tmp = tempfile.mkdtemp(dir=root)
            make_model_dir(os.path.join(tmp, "m"), "llama", seed=0)
            shutil.rmtree(path, ignore_errors=True)
            os.rename(os.path.join(tmp, "m"), path)
            shutil.rmtree(tmp, ignore_errors=True)
    return path
