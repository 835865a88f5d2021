"""A real `pagedllm serve` process for tests: free ports, wait until it answers, stop it and
check that it left no process or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.core.process.ipc import free_tcp_port
from pagedllm.core.process.local_workers import LAUNCHER_SERVER_ENV

from proc_helpers import children_of, is_running, pythonpath_with, segments_of, wait_until


def client(server) -> openai.OpenAI:
    """The real openai client, pointed at a ServerProcess."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body, content_type: str = "application/json") -> tuple[int, dict]:
    """POST a JSON-able body (or raw bytes) as a client that is not the openai package would:
    (status, the JSON answer), errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_text(server, path: str, body: dict) -> tuple[int, str]:
    """POST a JSON body to a route that answers in plain text (vLLM's adapter routes)."""
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServerProcess:
    def __init__(self, model: str, *flags: str, env: dict | None = None, zmq: bool = True):
        """zmq=False: no ZMQ entrypoint (replicas on Ray Serve have none)."""
        self.port = free_tcp_port()
        self.zmq_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}" if zmq else "none"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.cli",
                "serve",
                *(["--model", model] if model else []),  # none: the demo model
                "--port",
                str(self.port),
                "--zmq-endpoint",
                self.zmq_endpoint,
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # its engine starts its worker launcher itself: stop() checks its whole process tree
            env={k: v for k, v in (os.environ if env is None else env).items() if k != LAUNCHER_SERVER_ENV},
        )
        self.banner = self.proc.stdout.readline()
        if "serving" not in self.banner:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            self.proc.kill()
            raise RuntimeError(f"server did not start: {self.banner}{rest}")
        self.engine_pids = children_of(self.proc.pid)
        # keep reading what it prints: a full pipe would block the server mid-test
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels other than model_name folded in) -> value."""
        status, body = self.get("/metrics")
        assert status == 200
        values = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                values[s.name + (f"{{{extra}}}" if extra else "")] = s.value
        return values

    def settled_metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The metrics once the engine is idle and its step counts stop moving: its stats
        arrive apart from the outputs, so a step's may come after the response that it ended."""
        last = self.metrics()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.metrics()
            steps = "pagedllm:engine_steps_total"
            if now[steps] == last[steps] and now["pagedllm:num_requests_running"] == 0:
                return now
            last = now
        raise AssertionError(f"the engine did not settle within {timeout_s} s")

    def stop(self) -> None:
        """SIGINT, as Ctrl-C would; then everything it started must be gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("server did not stop on SIGINT") from None
        assert self.proc.returncode == 0, f"server exited with {self.proc.returncode}"
        assert wait_until(lambda: not any(is_running(p) for p in self.engine_pids), timeout_s=10), (
            "engine processes outlived the server"
        )
        for pid in self.engine_pids:
            assert not segments_of(pid), f"shared-memory segments of {pid} left behind"


def conversations(ask, tag: str, n: int = 5, turns: int = 3) -> tuple[list[list[str]], list[int]]:
    """n chats of `turns` turns, each turn the history so far (`tag` makes them a run's own);
    ask(messages) -> (the answer, its cached prompt tokens): (each chat's answers, the
    follow-up turns' cached prompt tokens)."""
    answers, cached = [], []
    for conv in range(n):
        messages = [{"role": "user", "content": f"{conv} ({tag}): the quick brown fox jumps over the lazy dog."}]
        said = []
        for turn in range(turns):
            text, hit = ask(messages)
            said.append(text)
            if turn:
                cached.append(hit)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Turn {turn}?"}]
        answers.append(said)
    return answers, cached


def chat_turns(api, model: str):
    """conversations()'s `ask` through an OpenAI client: greedy, 8 tokens a turn."""

    def ask(messages):
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens or 0

    return ask


# --- the shared server of test_serving.py and test_serving_trust.py ------------------------
# Its processes import a sitecustomize that plants a bug in the engine core, so that tests can
# cause an error in the core's handling of one request (see test_serving_trust.py).
SERVED_MAX_MODEL_LEN = 512
PLANTED_PENALTY = 4.25

SITECUSTOMIZE = f"""
import numpy  # noqa: F401 - before the patch, so that a torch-free process imports what it would
from pagedllm.core.scheduling import beam_search

_step = beam_search.BeamGroup.step


def _planted(self, candidates, histories):
    if self.length_penalty == {PLANTED_PENALTY}:
        raise OverflowError("(34, 'Numerical result out of range')")
    return _step(self, candidates, histories)


beam_search.BeamGroup.step = _planted
"""

# roles must alternate (a template's own refusal, as many models' templates do); any role name is taken
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def strict_template_model(base: str, path: str) -> str:
    """A copy of the model folder `base` at `path` whose chat template is CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    shutil.copytree(base, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def planted_bug_env(folder) -> dict:
    """The environment under which Python processes import the planted bug (from `folder`)."""
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dict(os.environ, PYTHONPATH=pythonpath_with(folder))
