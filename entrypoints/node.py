"""`pagedllm worker`: the tensor-parallel ranks of one more host. It starts this node's ranks
(`python -m pagedllm.backends.worker`), which join the engine core over tcp:// ZeroMQ and the
other ranks through torch.distributed's rendezvous (the head's master address and port, sent
to them by the core), and stays until they end. Ranks split evenly over the nodes in node
order: node k runs ranks k*T/N .. (k+1)*T/N - 1 of T ranks on N nodes."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

logger = logging.getLogger("pagedllm.entrypoints")


def node_ranks(tensor_parallel_size: int, nnodes: int, node_rank: int) -> range:
    if nnodes < 2 or not 0 < node_rank < nnodes:
        raise ValueError(f"--node-rank: must be in 1..{nnodes - 1} (node 0 is the head), got {node_rank}")
    if tensor_parallel_size % nnodes:
        raise ValueError(f"--nnodes: {nnodes} nodes cannot share {tensor_parallel_size} ranks evenly")
    per_node = tensor_parallel_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def run_node(head: str, ranks: range) -> int:
    """Start the ranks and wait; the first to fail ends the others. Returns an exit status."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "pagedllm.backends.worker", "--head", head, "--rank", str(r)])
        for r in ranks
    ]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    print(f"pagedllm: ranks {list(ranks)} joining {head}", flush=True)
    code = 0
    try:
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        code = next((c for c in codes if c), 0)
        if code:
            logger.error("a rank exited with %d; stopping this node's others", code)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return code
