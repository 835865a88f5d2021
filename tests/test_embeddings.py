"""Embeddings (`--runner pooling`): /v1/embeddings through the real `openai` client and
`LLM.embed`, against transformers' final hidden states pooled the same way, for each pooling
type; prompts long enough to be prefilled in several chunks, batched."""

from __future__ import annotations

import base64
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from serve_helpers import ServerProcess, client, post

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks.",
    "A scheduler decides which tokens run; a worker computes them.",
    "Naïve café",
    [5, 6, 7, 8, 9, 10, 11],
]
POOLING = {  # the pooling type -> the server's extra flags
    "LAST": [],
    "MEAN": [],
    "CLS": ["--tensor-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> str:
    """A tiny llama whose config says it is a matryoshka model (its embeddings may be cut short)."""
    path = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return str(path)


@pytest.fixture(scope="module")
def servers(model):
    def start(kind):
        flags = ["--runner", "pooling", "--pooler-config", json.dumps({"pooling_type": kind}), *POOLING[kind]]
        # chunks of at most 16 tokens: a long prompt is pooled over several steps
        flags += ["--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--zmq-endpoint", "none"]
        return ServerProcess(model, *flags)

    with ThreadPoolExecutor(len(POOLING)) as pool:
        started = dict(zip(POOLING, pool.map(start, POOLING)))
    yield started
    for server in started.values():
        server.stop()


def transformers_embeddings(model: str, kind: str) -> list[np.ndarray]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
        pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
        out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return out


@pytest.mark.parametrize("kind", list(POOLING))
def test_embeddings_are_transformers_pooled_hidden_states(servers, model, kind):
    api = client(servers[kind])
    expected = transformers_embeddings(model, kind)
    got = api.embeddings.create(model=model, input=PROMPTS, encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(PROMPTS)))
    for d, want in zip(got.data, expected):
        np.testing.assert_allclose(np.array(d.embedding), want, atol=1e-5, rtol=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0

    # base64, as the openai client asks by default: the same float32 bits
    packed = api.embeddings.create(model=model, input=PROMPTS[:2], encoding_format="base64")
    for d, plain in zip(packed.data, got.data):
        assert np.array_equal(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"), np.float32(plain.embedding))

    # the same prompt again: LAST may take the prefix cache (its vector unchanged), MEAN and CLS
    # must compute every token
    again = api.embeddings.create(model=model, input=PROMPTS[0], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(np.array(again), expected[0], atol=1e-5, rtol=0)
    metrics = servers[kind].settled_metrics()
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0.0  # nothing held once they finish
    hits = metrics.get("pagedllm:prefix_cache_hits_total", 0)
    assert (hits > 0) if kind == "LAST" else hits == 0


def test_matryoshka_dimensions_and_bad_bodies(servers, model):
    server = servers["MEAN"]
    api = client(server)
    full = np.array(api.embeddings.create(model=model, input=PROMPTS[1], encoding_format="float").data[0].embedding)
    short = api.embeddings.create(model=model, input=PROMPTS[1], dimensions=16, encoding_format="float")
    np.testing.assert_allclose(np.array(short.data[0].embedding), full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    bad = [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", [1, 10**6]]}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x" * 5000}, "input"),  # longer than the context
    ]
    for body, field in bad:
        status, err = post(server, "/v1/embeddings", body)
        assert 400 <= status < 500 and err["error"]["param"] == field, (body, status, err)
    with pytest.raises(openai.BadRequestError) as e:  # a pooling engine writes no text
        api.completions.create(model=model, prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    status, out = post(server, "/invocations", {"input": PROMPTS[1], "encoding_format": "float"})
    assert status == 200 and np.allclose(out["data"][0]["embedding"], full)


def test_llm_embed_and_mean_embeddings_through_worker_kills(tiny_model):
    """LLM.embed equals transformers' mean; then workers SIGKILLed while long prompts are pooled
    in chunks of 16: the MEAN's partial sums die with them, so the core computes those prompts
    again; every run's vectors are the same."""
    import time

    from transformers import AutoModel

    from pagedllm import LLM

    from proc_helpers import Killer, engine_processes, segments_of

    model = tiny_model("llama")
    prompts = [[5 + (i * 7 + j) % 380 for j in range(40 + 9 * i)] for i in range(12)]
    engine = dict(
        runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False}, max_num_batched_tokens=16
    )
    with LLM(model, **engine) as llm:  # LLM.embed, unnormalized: transformers' mean itself
        out = llm.embed(prompts, use_tqdm=False)
        with pytest.raises(Exception, match="runner pooling"):  # such an engine writes no text
            llm.generate(["hi"], use_tqdm=False)
    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, o in zip(prompts, out):
        with torch.no_grad():
            mean = hf(torch.tensor([prompt])).last_hidden_state[0].mean(0)
        assert o.prompt_token_ids == prompt
        np.testing.assert_allclose(np.array(o.outputs.embedding), mean.numpy(), atol=1e-5, rtol=0)
    expected = np.array([o.outputs.embedding for o in out])
    with LLM(model, **engine, max_worker_restarts=3) as llm:
        killer = Killer(llm.engine.pid, times=3, launcher_pid=llm.engine.ready.launcher_pid, delay=(0.1, 0.4))
        killer.start()
        runs, deadline = [], time.monotonic() + 60
        while len(killer.killed) < killer.times and time.monotonic() < deadline:
            runs.append(np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]))
        killer.stop.set()
        killer.join()
        runs.append(np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]))
        stats, engine_client = llm.last_stats, llm.engine
    assert len(killer.killed) == 3 and stats.worker_restarts == 3
    for got in runs:
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert not engine_processes(engine_client) and not segments_of(engine_client.pid)
