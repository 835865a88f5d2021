"""KV events in vLLM's wire format (`--kv-events-config`): a plain pyzmq subscriber, with the
types a router would declare, rebuilds the prefix cache from the stream (and the replay
socket, for what it joined too late to see) and finds what the engine's own pool holds:
through evictions, reset_prefix_cache and a worker replaced."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.core.process.ipc import free_tcp_port
from pagedllm.core.scheduling.block_pool import hash_block_tokens

from proc_helpers import wait_until, workers_of


# the subscriber's own declarations of vLLM 0.34's types, as a router writes them
class Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class CacheView:
    """The prefix cache as the events tell it: hash -> the block's token ids."""

    def __init__(self, pub: int, replay: int):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.replay_port = replay
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.blocks: dict[int, list[int]] = {}
        self.loras: dict[int, tuple[int | None, str | None]] = {}  # hash -> (lora_id, lora_name)
        self.next_seq = 0
        self.cleared = 0
        self.removed = 0
        self.block_sizes: set[int] = set()

    def apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return
        assert seq == self.next_seq, f"message {seq} came before {self.next_seq}"
        self.next_seq = seq + 1
        for event in self.decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                self.block_sizes.add(event.block_size)
                for h in event.block_hashes:
                    assert event.parent_block_hash is None or event.parent_block_hash in self.blocks
                    self.blocks[h] = event.token_ids
                    self.loras[h] = (event.lora_id, event.lora_name)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[h]  # a block removed was stored before
                    self.removed += 1
            else:
                self.blocks.clear()
                self.cleared += 1

    def replay_missed(self) -> None:
        """What was published before this subscriber joined (or was dropped), from the replay socket."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send(self.next_seq.to_bytes(8, "big"))
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            seq, payload = dealer.recv_multipart()
            if not payload:  # the end marker
                break
            self.apply(int.from_bytes(seq, "big"), payload)
        dealer.close()

    def drain(self, quiet_s: float = 0.5) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            _, seq, payload = self.sub.recv_multipart()
            if int.from_bytes(seq, "big") > self.next_seq:  # a gap: fetch it first
                self.replay_missed()
            self.apply(int.from_bytes(seq, "big"), payload)

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def expected_hashes(prompt: list[int], block_size: int) -> list[int]:
    """The wire hashes of a prompt's full blocks, as a router computes them from token ids: the
    core's chained keys, modulo 2**64."""
    keys, parent = [], None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(prompt[start : start + block_size]))
        keys.append(parent % 2**64)
    return keys


def test_a_subscriber_rebuilds_the_prefix_cache_through_evictions_resets_and_a_worker_restart(tiny_model):
    pub, replay = free_tcp_port(), free_tcp_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    shared = list(range(10, 74))  # four blocks of 16 every prompt starts with
    prompts = [shared + [100 + i] * (8 + 5 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = dict(kv_events_config=config, num_kv_blocks=20, block_size=16, max_model_len=256, max_worker_restarts=1)
    with LLM(tiny_model("llama"), skip_tokenizer_init=True, **engine) as llm:
        view = CacheView(pub, replay)
        llm.generate(prompts, params, use_tqdm=False)  # more blocks than the pool: evictions
        view.drain()
        view.replay_missed()  # published before the subscriber had joined
        view.drain()
        stats = llm.last_stats.scheduler
        assert len(view.blocks) == stats.num_cached_blocks > 0 and view.block_sizes == {16}
        assert set(expected_hashes(prompts[-1], 16)[:4]) <= set(view.blocks)  # the shared prefix, as keyed
        assert all(len(tokens) == 16 for tokens in view.blocks.values()) and view.removed > 0

        llm.reset_prefix_cache()
        assert wait_until(lambda: (view.drain(0.2), view.cleared)[1] == 1, timeout_s=10)
        assert view.blocks == {}

        llm.generate(prompts[:2], params, use_tqdm=False)
        (victim,) = workers_of(llm.engine.pid, llm.engine.ready.launcher_pid)
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
        llm.generate(prompts[2:4], params, use_tqdm=False)  # after the restart: the whole cache again
        view.drain()
        stats = llm.last_stats
        assert stats.worker_restarts == 1 and view.cleared == 2
        assert len(view.blocks) == stats.scheduler.num_cached_blocks > 0
    view.close()
