"""Stands in for vLLM's `tests.utils.RemoteOpenAIServer` when vLLM's own server tests run
against `pagedllm serve` (see run.py): the hub model a test names is served from a local
folder under that name, and the vLLM flags pagedllm has are passed on (the rest are GPU
settings, dropped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import openai

from pagedllm.core.process.ipc import free_tcp_port

MODELS = json.loads(os.environ.get("PAGEDLLM_VLLM_MODELS", "{}"))  # hub name -> local folder


def _known_flags() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--help"], capture_output=True, text=True)
    return {word.strip("[],") for word in out.stdout.split() if word.startswith("--")}


def _translated(args: list[str]) -> list[str]:
    known, kept, i = _known_flags(), [], 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        takes_value = "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("--")
        if flag in known:
            kept += args[i : i + (2 if takes_value else 1)]
        else:
            print(f"[pagedllm] dropped {args[i : i + (2 if takes_value else 1)]}", file=sys.stderr)
        i += 2 if takes_value else 1
    return kept


class RemoteOpenAIServer:
    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict | None = None, **_ignored):
        if model not in MODELS:
            raise RuntimeError(f"no local folder for {model!r}: add it to PAGEDLLM_VLLM_MODELS")
        self.port = free_tcp_port()
        self.host = "127.0.0.1"
        self.url_root = f"http://{self.host}:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", MODELS[model], "--served-model-name", model]
        cmd += ["--port", str(self.port), "--zmq-endpoint", "none", *_translated(list(vllm_serve_args))]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env_dict or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url_for("health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pagedllm serve exited with {self.proc.returncode}") from None
                time.sleep(0.2)
        raise RuntimeError("pagedllm serve did not start")

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="EMPTY", max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="EMPTY", max_retries=0, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)
