"""The peer side of a throughput run's rounds, for the peer scripts (vllm_peer.py,
llama_cpp_peer.py) in their own environments: imports nothing from pagedllm. Before each round
the script says it is ready on stdout and waits for the bench to say go on stdin, so that
pagedllm's rounds and each peer's take turns on the same machine (bench_throughput.py)."""

import sys
import time

READY, GO, DONE = "peer-ready", "go", "peer-done"


def timed_rounds(workloads: list, run) -> tuple[list[float], list]:
    """run(workload) for each workload when told to: (seconds of each, the first's outputs)."""
    seconds, first = [], None
    for workload in workloads:
        print(READY, flush=True)
        if sys.stdin.readline().strip() != GO:
            raise SystemExit("the bench stopped asking for rounds")
        start = time.monotonic()
        outputs = run(workload)
        seconds.append(time.monotonic() - start)
        print(DONE, seconds[-1], flush=True)
        first = outputs if first is None else first
    return seconds, first
