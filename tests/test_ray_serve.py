"""`pagedllm serve --data-parallel-size 2`: two engine replicas on Ray Serve behind one
endpoint and the prefix-aware router, through the real `openai` client. A conversation's
follow-up turns find their prefix cached, answers equal one engine's, a client that leaves
aborts its request on its replica, /metrics and /health cover both replicas, an adapter loaded
at run time is loaded on both, and a replica killed under load is replaced (adapter included)
while the endpoint keeps answering."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pagedllm import LLM, SamplingParams

from proc_helpers import children_of, is_running, segments_of, wait_until
from serve_helpers import ServerProcess, chat_turns, client, conversations, post_text

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pagedllm[ray]')")


def replica_pids(server) -> list[int]:
    """The engine replicas' actor processes (Ray names them ServeReplica:APP:DEPLOYMENT)."""
    found = []
    for pid in children_of(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ServeReplica:pagedllm:EngineReplica" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return sorted(found)


def running_per_replica(server) -> dict[str, float]:
    values = server.metrics()
    return {k: v for k, v in values.items() if k.startswith("vllm:num_requests_running{")}


def finished_per_replica(server) -> dict[str, float]:
    finished: dict[str, float] = {}
    for key, value in server.metrics().items():
        if key.startswith("pagedllm:request_success_total{"):
            replica = key.split("replica=")[1].split(",")[0].rstrip("}")
            finished[replica] = finished.get(replica, 0) + value
    return finished


def every_replica_answers_under(server, adapter: str, tag: str) -> None:
    """Requests under `adapter` until each replica has answered some (the router takes turns
    among replicas equally loaded): none refused."""
    before, api = finished_per_replica(server), client(server)
    for i in range(6):
        reply = api.completions.create(model=adapter, prompt=f"{tag} {i}", max_tokens=2)
        assert reply.model == adapter and reply.choices[0].finish_reason == "length"
    after = finished_per_replica(server)
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)


@pytest.fixture(scope="module")
def replicas(tiny_model):
    model = tiny_model("llama")
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    args = ("--data-parallel-size", "2", "--max-num-seqs", "16", "--enable-lora", "--max-lora-rank", "8")
    server = ServerProcess(model, *args, zmq=False, env=env)
    yield model, server
    server.stop()


def test_follow_up_turns_go_to_the_replica_holding_their_prefix(replicas):
    model, server = replicas
    routed, cached = conversations(chat_turns(client(server), model), tag="ray", n=6)
    hit_rate = sum(c > 0 for c in cached) / len(cached)
    print(f"follow-up turns with a prefix-cache hit through the prefix-aware router: {hit_rate:.0%}")
    assert hit_rate >= 0.9, cached
    assert len(running_per_replica(server)) == 2  # both replicas answered /metrics, each labelled
    with LLM(model) as one:  # greedy: the answers are one engine's, whichever replica gave them
        greedy = SamplingParams(temperature=0, max_tokens=8)
        ask = lambda messages: (one.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text, 0)
        assert routed == conversations(ask, tag="ray", n=6)[0]


def test_a_client_that_leaves_aborts_its_request_on_its_replica(replicas):
    model, server = replicas
    aborted = "pagedllm:request_success_total{finished_reason=abort"
    count = lambda: sum(v for k, v in server.metrics().items() if k.startswith(aborted))
    before = count()
    stream = client(server).completions.create(
        model=model, prompt="a long answer", max_tokens=900, n=8, extra_body={"ignore_eos": True}, stream=True
    )
    next(iter(stream))
    stream.close()  # 8 x 900 tokens: far from done
    assert wait_until(lambda: count() - before == 8, timeout_s=10), count() - before
    assert wait_until(lambda: sum(running_per_replica(server).values()) == 0, timeout_s=10)
    assert server.get("/health")[0] == 200


def test_an_adapter_loaded_at_run_time_is_loaded_on_every_replica(replicas, tmp_path_factory):
    from pagedllm.benchmarks.bench_lora import write_adapter

    model, server = replicas
    path = write_adapter(model, str(tmp_path_factory.mktemp("lora") / "sql"), seed=0, rank=8)
    assert post_text(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": path})[0] == 200
    status, text = post_text(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": path})
    assert status == 400 and "already been loaded" in text
    every_replica_answers_under(server, "sql", "before")
    assert post_text(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": path})[0] == 200
    assert post_text(server, "/v1/unload_lora_adapter", {"lora_name": "gone"})[0] == 200
    for _ in range(4):  # whichever replica answers
        assert {m.id for m in client(server).models.list().data} == {model, "sql"}


def test_a_replica_killed_under_load_is_replaced_and_the_endpoint_keeps_answering(replicas):
    model, server = replicas
    victims = replica_pids(server)
    assert len(victims) == 2
    victim = victims[0]
    engine = children_of(victim)  # its engine core and workers
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    started = threading.Semaphore(0)

    def one(i: int) -> str:
        try:
            stream = api.completions.create(
                model=model, prompt=f"request {i}", max_tokens=300, extra_body={"ignore_eos": True}, stream=True
            )
            for n, chunk in enumerate(stream):
                if n == 2:
                    started.release()
                last = chunk
            return "completed" if last.choices[0].finish_reason == "length" else "cut short"
        except openai.APIError as e:
            started.release()
            return f"failed: {e}"

    def whole(i: int) -> str:  # not streamed: nothing reaches the client before the answer is done
        reply = api.completions.create(
            model=model, prompt=f"whole {i}", max_tokens=300, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(12) as pool:
        wholes = [pool.submit(whole, i) for i in range(4)]
        results = [pool.submit(one, i) for i in range(8)]
        for _ in range(8):
            started.acquire(timeout=30)
        os.kill(victim, signal.SIGKILL)
        outcomes = [r.result() for r in results]
        whole_outcomes = [w.result() for w in wholes]
    completed = sum(o == "completed" for o in outcomes)
    failed = [o for o in outcomes if o != "completed"]
    print(f"replica killed under load: {completed} of 8 streams completed, {len(failed)} failed: {failed}")
    # new requests go to the least loaded replica: both had some
    assert completed >= 1 and failed and all(o.startswith("failed") for o in failed)
    # an answer not begun when its replica died was sent to the other replica: none failed
    assert whole_outcomes == ["length"] * 4
    retried = sum("sending it to another" in line for line in server.output)
    print(f"{retried} of the 4 whole answers were retried on the other replica")
    # the endpoint answers at once, from the replica that is left (or the new one)
    for i in range(4):
        reply = api.completions.create(model=model, prompt=f"after {i}", max_tokens=4)
        assert reply.choices[0].finish_reason == "length"
    assert server.get("/health")[0] == 200
    # the dead replica's engine went with it; Ray Serve starts another replica
    assert wait_until(lambda: not any(is_running(p) for p in engine), timeout_s=15)
    assert all(not segments_of(p) for p in engine)
    assert wait_until(lambda: len(replica_pids(server)) == 2 and len(running_per_replica(server)) == 2, timeout_s=60)
    assert victim not in replica_pids(server)
    every_replica_answers_under(server, "sql", "after")  # the new replica got the adapter loaded at run time


# --- the router's policy, apart from Ray ---------------------------------------------------
def test_prefix_affinity_follows_the_longest_prefix_unless_the_loads_drift_apart():
    from pagedllm.entrypoints.ray_serve.affinity import PrefixAffinity

    policy = PrefixAffinity(imbalance=4)
    first = "user:" + "a conversation about paged attention and its block tables " * 3
    assert policy.rank(["a", "b"], first)[0] == "a"  # nothing remembered: the least loaded, then the first
    policy.sent("a")
    policy.remember("a", first)
    other = "user:" + "another conversation, on continuous batching of requests " * 3
    assert policy.rank(["a", "b"], other)[0] == "b"  # a new conversation: the idle replica
    policy.sent("b")
    policy.remember("b", other)
    follow_up = first + "assistant:blocks\nuser:and then?\n"
    assert policy.rank(["a", "b"], follow_up)[0] == "a"  # its prefix is on a
    for _ in range(4):
        policy.sent("a")
    assert policy.rank(["a", "b"], follow_up)[0] == "a"  # 5 in flight against 1: still within 4 of each other
    policy.sent("a")
    assert policy.rank(["a", "b"], follow_up)[0] == "b"  # 6 against 1: the least loaded
    for _ in range(6):
        policy.done("a")
    policy.forget("a")  # a replaced replica starts with an empty cache
    assert policy.rank(["a", "b"], follow_up)[0] == "a"  # no match anywhere: the least loaded
    assert PrefixAffinity(policy="round_robin").rank(["a", "b"], follow_up) == ["a", "b"]
    burst = PrefixAffinity()  # new conversations ranked before any was sent: taken in turn
    assert [burst.rank(["a", "b"], f"user:conversation number {i} " * 4)[0] for i in range(4)] == ["a", "b", "a", "b"]
