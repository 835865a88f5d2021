"""KV-cache events in vLLM's wire format, for the routers that read them (Ray Serve's KV-aware
router, llm-d, Dynamo, vllm-router): the prefix cache's blocks as they are stored, removed and
all cleared, msgpack (msgspec) over a ZeroMQ PUB socket, each message numbered, with a replay
socket for what a subscriber missed.

A PUB message is three frames: the topic, the sequence number (8 bytes, big-endian) and a
`KVEventBatch` (vLLM 0.34's types: the batch an array, each event a map tagged "type"). The
replay socket (ROUTER) takes a first sequence number (8 bytes, big-endian) and answers each
buffered message from it as [seq, payload], then [-1 (8 bytes, signed), b""].

A block's hash is the core's prefix-cache key, `hash((parent_key or -1, tuple(token_ids)))`
with Python's own tuple hash (core/scheduling/block_pool.py), which does not vary between
processes, taken modulo 2**64 on the wire (`wire_hash`); each BlockStored also carries the
block's token ids and its parent's hash, so a subscriber can index blocks by token content
without computing keys at all.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

logger = logging.getLogger("pagedllm.core")


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `--kv-events-config` fields."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" publishes nothing
    endpoint: str = "tcp://*:5557"  # bound (vLLM's default), or connected where it names no wildcard host
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # messages kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix cache: a map tagged with its class name in "type" (vLLM 0.34's
    encoding, which vllm-router reads; the batch around the events is an array)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_hash(key: int) -> int:
    """A block's key as it goes on the wire: unsigned 64-bit (the key taken modulo 2**64), as
    readers of vLLM's events require."""
    return key & 0xFFFF_FFFF_FFFF_FFFF


def batch_of(pool_events: list[tuple], block_size: int) -> KVEventBatch:
    """The block pool's records (core/scheduling/block_pool.py) as one batch."""
    events: list[Any] = []
    for record in pool_events:
        if record[0] == "stored":
            _, key, parent, token_ids, lora = record
            parent = wire_hash(parent) if parent is not None else None
            lora_id, lora_name = (lora.lora_int_id, lora.lora_name) if lora is not None else (None, None)
            events.append(BlockStored([wire_hash(key)], parent, list(token_ids), block_size, lora_id, "GPU", lora_name))
        elif record[0] == "removed":
            events.append(BlockRemoved([wire_hash(record[1])], "GPU"))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(time.time(), events)


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Publishes batches from a thread of its own (the core's loop only queues them): PUB for
    the stream, ROUTER for replays of the last `buffer_steps` messages."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = zmq.Context()
        self._pub = self._socket(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = self._socket(zmq.ROUTER, config.replay_endpoint) if config.replay_endpoint else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")) or kind == zmq.ROUTER:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        return sock

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a subscriber that cannot keep up loses events (and can replay them)
            logger.warning("KV event queue full: a batch of %d events dropped", len(batch.events))

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None and poller.poll(0):
                self._answer_replay(buffer)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            payload = encoder.encode(batch)
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self, buffer: deque) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
        head = frames[1:-1]  # a REQ client's empty delimiter, kept in each reply
        for seq, payload in list(buffer):
            if seq >= start:
                self._replay.send_multipart((client, *head, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, *head, END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()
