"""A real nginx with docs/deploy/nginx.conf in front of `pagedllm serve`: streamed chunks pass
through one by one while the answer is still being generated, not all at the end."""

from __future__ import annotations

import os
import shutil
import subprocess

import openai
import pytest

from pagedllm.core.process.ipc import free_tcp_port

from proc_helpers import wait_until
from serve_helpers import ServerProcess

CONF = os.path.join(os.path.dirname(__file__), "..", "docs", "deploy", "nginx.conf")


@pytest.fixture
def nginx_binary():
    path = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )
    if path is None:
        pytest.skip("nginx is not installed (.ci/run installs it with apt-get when it can)")
    return path


def test_streamed_chunks_pass_through_nginx_one_by_one(nginx_binary, tiny_model, tmp_path):
    model = tiny_model("llama")
    server = ServerProcess(model, "--num-kv-blocks", "128")
    port = free_tcp_port()
    with open(CONF) as f:
        conf = (
            f.read()
            .replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
            .replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        )
    (tmp_path / "nginx.conf").write_text(conf)
    for d in ("logs", "tmp"):
        (tmp_path / d).mkdir()
    nginx = subprocess.Popen(
        [
            nginx_binary,
            "-p",
            str(tmp_path),
            "-c",
            str(tmp_path / "nginx.conf"),
            "-e",
            str(tmp_path / "logs/error.log"),
            "-g",
            f"daemon off; pid {tmp_path}/nginx.pid;",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        via = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=5)
        assert wait_until(lambda: _answers(via), timeout_s=20, interval=0.1), "nginx did not come up"
        stream = via.completions.create(
            model=model, prompt=[5, 6, 7], max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].text is not None
        # the first chunk is here while the server is still generating this answer
        assert server.metrics()["pagedllm:num_requests_running"] == 1
        rest = list(chunks)
        assert len(rest) >= 100 and rest[-1].choices[0].finish_reason == "length"
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        server.stop()


def _answers(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
        return True
    except openai.APIError:
        return False
