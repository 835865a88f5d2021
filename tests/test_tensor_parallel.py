"""Tensor parallelism on torch.distributed (gloo on this CPU): two worker processes, each with
half of the heads and of the MLP, must give the tokens of one — under preemption and chunked
prefill, for every architecture, with n > 1 and beam search — and fail cleanly when a rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from pagedllm import LLM, BeamSearchParams, InvalidParameter, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.process.ipc import free_tcp_port
from pagedllm.core.process.worker_group import WorkerGroup, rank_identity
from pagedllm.core.protocol import Decoder, Encoder, Step, StepResult, ToWorker, WorkerFailed
from pagedllm.entrypoints.engine_args import EngineArgs
from pagedllm.entrypoints.engine_client import EngineDeadError

from core_helpers import add, make_scheduler
from model_helpers import greedy_batched, make_runner
from proc_helpers import is_running, segments_of, wait_until, workers_of

MODELS = {  # name: (architecture, config overrides)
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama3-rope", {}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mqa-odd-vocab": ("llama", {"num_key_value_heads": 1, "model_vocab_size": 1003}),  # 1 KV head, 2 ranks
    # every expert's intermediate split by rows (its window off: released blocks would leave
    # this pool too roomy to preempt; test_model_coverage preempts it windowed, on one rank)
    "mixtral-experts": ("mixtral", {"sliding_window": None}),
    "phi3-fused-longrope": ("phi3", {"sliding_window": None}),  # q/k/v, gate/up saved fused: cut per part
}


def prompts_16() -> list[list[int]]:
    """16 mixed lengths, 1 to 150 tokens."""
    lengths = [1, 150, 3, 40, 17, 16, 90, 5, 120, 33, 2, 64, 100, 9, 48, 71]
    return [[(7 * i + 3 * j) % 390 + 5 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_greedy_equals_one_rank_under_preemption_and_chunked_prefill(tiny_model, name):
    arch, overrides = MODELS[name]
    path = tiny_model(arch, **overrides)
    prompts, max_new = prompts_16(), 10
    expected = greedy_batched(make_runner(path), prompts, max_new)
    mode = "swap" if name == "llama" else "recompute"
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    with LLM(
        path,
        tensor_parallel_size=2,
        num_kv_blocks=40,
        max_model_len=256,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        swap_space=0.01,
        skip_tokenizer_init=True,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        preemptions = llm.last_stats.scheduler.num_preemptions
        ready = llm.engine.ready
    assert preemptions > 0, "the pool was meant to force preemption"
    assert len(ready.kv_segments) == 2 and all(ready.kv_segments), "one shared-memory segment per rank"
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.outputs[0].token_ids == want, f"request {i} ({len(prompts[i])}-token prompt)"


def test_tp2_n_samples_beams_logit_bias_prefix_hits_and_decode_runs_equal_one_rank(tiny_model):
    path = tiny_model("llama")
    shared = list(range(20, 84))  # 4 full blocks that later prompts hit
    prompts = [shared + [5, 6], shared + [7], [9, 10, 11]]
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    biased = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logit_bias={t: -100.0 for t in range(0, 400, 2)}
    )
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    long = SamplingParams(temperature=0.8, seed=5, max_tokens=60, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        # runs of 4 steps, whatever a step takes (two ranks on two cores: several ms)
        engine = dict(num_kv_blocks=128, max_model_len=256, skip_tokenizer_init=True, num_scheduler_steps=4)
        with LLM(path, tensor_parallel_size=tp, **engine) as llm:
            samples = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled, use_tqdm=False)]
            searched = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts[:2], beams)]
            odd = [o.outputs[0].token_ids for o in llm.generate(prompts, biased, use_tqdm=False)]  # rank 0 biases
            hits = llm.last_stats.scheduler.prefix_cache_hits
            # one request decoding alone: decode runs, every rank taking rank 0's token each step
            steady = llm.generate([[9, 10, 11]], long, use_tqdm=False)[0].outputs[0].token_ids
            runs[tp] = (samples, searched, odd, steady, hits, llm.last_stats.steps_in_runs)
    assert runs[2][:4] == runs[1][:4]
    assert all(t % 2 for out in runs[2][2] for t in out)
    assert runs[2][4] > 0 and runs[2][5] > 0


def test_two_launches_meet_through_the_rendezvous(tiny_model):
    """The head (this process's engine) holds rank 0; `pagedllm worker`, started apart as a
    second node would be, holds rank 1; they meet over tcp:// and torch.distributed's store."""
    path = tiny_model("llama")
    workers, master = free_tcp_port(), free_tcp_port()
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "worker",
            "--head",
            f"tcp://127.0.0.1:{workers}",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--tensor-parallel-size",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    prompts, max_new = prompts_16()[:6], 8
    expected = greedy_batched(make_runner(path), prompts, max_new)
    try:
        with LLM(
            path,
            tensor_parallel_size=2,
            nnodes=2,
            worker_endpoint=f"tcp://127.0.0.1:{workers}",
            master_port=master,
            num_kv_blocks=64,
            max_model_len=256,
            skip_tokenizer_init=True,
        ) as llm:
            out = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False
            )
            assert llm.engine.ready.kv_segments[0] and llm.engine.ready.kv_segments[1] is None
        assert [o.outputs[0].token_ids for o in out] == expected
        assert node.wait(timeout=30) == 0, node.stdout.read()
    finally:
        if node.poll() is None:
            node.kill()


def test_a_killed_rank_fails_every_request_within_10_s_and_leaves_nothing(tiny_model):
    """With no restarts allowed; with them, the ranks are replaced (test_worker_recovery.py)."""
    llm = LLM(
        tiny_model("llama"),
        tensor_parallel_size=2,
        num_kv_blocks=512,
        max_model_len=1024,
        skip_tokenizer_init=True,
        max_worker_restarts=0,
    )
    core, launcher = llm.engine.pid, llm.engine.ready.launcher_pid
    ranks = workers_of(core, launcher)
    assert len(ranks) == 2 and len(segments_of(core)) == 2
    killed = {}

    def kill():
        killed["at"] = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(EngineDeadError, match="worker 1"):
        llm.generate([[5] * 40] * 32, SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed["at"] < 10
    llm.shutdown()
    assert wait_until(lambda: not any(is_running(p) for p in [core, launcher, *ranks]), timeout_s=10)
    assert not segments_of(core) and not os.path.exists(llm.engine.ipc_dir)


def test_a_size_the_model_cannot_split_is_refused_before_anything_starts(tiny_model, monkeypatch):
    path = tiny_model("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(InvalidParameter, match="tensor_parallel_size: 3 does not divide the model's 4 attention"):
        EngineArgs(model=path, tensor_parallel_size=3).engine_config()
    monkeypatch.setattr("pagedllm.entrypoints.engine_args.device_count", lambda backend: 1)
    with pytest.raises(InvalidParameter, match="2 ranks on this host, but cpu sees 1 devices"):
        EngineArgs(model=path, tensor_parallel_size=2).engine_config()


def test_a_step_is_encoded_once_and_every_rank_gets_the_same_frames(monkeypatch):
    ctx = zmq.Context()
    group = WorkerGroup(ctx, "tcp://127.0.0.1:*", EngineConfig(model="m", tensor_parallel_size=2))
    ranks = []
    for rank in range(2):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, rank_identity(rank))
        sock.connect(group.endpoint)
        ranks.append(sock)
    time.sleep(0.3)  # the connections are up
    sched = make_scheduler()
    add(sched, "a", range(1, 20))
    plan = sched.schedule()
    encodes = []
    real = group.encoder.encode
    monkeypatch.setattr(group.encoder, "encode", lambda msg: encodes.append(msg) or real(msg))
    group.broadcast(Step(plan))
    frames = [sock.recv_multipart() for sock in ranks]
    assert len(encodes) == 1 and frames[0] == frames[1]
    assert Decoder(ToWorker).decode(frames[0]).plan.num_scheduled_tokens == {"a": 19}
    for sock in ranks:
        sock.close(linger=0)
    group.sock.close(linger=0)
    ctx.term()


def test_a_message_of_a_replaced_worker_group_is_dropped_not_taken_for_the_new_ones():
    """After a restart, what the old ranks sent before they died may still be queued: rank 0's
    report that its collective failed, or a step result. Stamped with the old generation, it
    is dropped; read as the new group's answer it would end the engine (or cost a restart)."""
    ctx = zmq.Context()
    group = WorkerGroup(ctx, "tcp://127.0.0.1:*", EngineConfig(model="m", tensor_parallel_size=2))
    old = ctx.socket(zmq.DEALER)
    old.setsockopt(zmq.ROUTING_ID, rank_identity(0))
    old.connect(group.endpoint)
    encoder = Encoder()
    old.send_multipart(encoder.encode(WorkerFailed(rank=0, reason="gloo: connection closed", generation=0)))
    old.send_multipart(encoder.encode(StepResult(step_id=6, sampled_token_ids=np.zeros(1, np.int64), generation=0)))
    time.sleep(0.3)  # both are queued at the core
    group.generation = 1  # as restart() counts it
    old.send_multipart(encoder.encode(StepResult(step_id=7, sampled_token_ids=np.zeros(1, np.int64), generation=1)))
    assert group.wait_result(StepResult).step_id == 7
    old.close(linger=0)
    group.sock.close(linger=0)
    ctx.term()
