"""The worker launcher's process settings."""

import os
import subprocess
import sys

from pagedllm.backends.launcher import SPIN_ROUNDS, openmp_wait_defaults


def test_openmp_threads_spin_briefly_unless_the_user_chose():
    assert openmp_wait_defaults({}) == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    assert openmp_wait_defaults({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait_defaults({"GOMP_SPINCOUNT": "infinite"}) == {}


def _launcher_env() -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (
        "import os, sys; import pagedllm.backends.launcher; "
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_the_launcher_sets_the_spin_count_its_workers_inherit():
    assert _launcher_env().split() == [str(SPIN_ROUNDS), "None"]


# blocks of a few MiB, as a prefill's activations are, allocated, written and freed ten times:
# the page faults the ten rounds take
_HEAP_ROUNDS = """
import resource, sys
from pagedllm.backends.heap import keep_freed_memory
print(keep_freed_memory({} if sys.argv[1] == "keep" else {"MALLOC_ARENA_MAX": "2"}))
def round_():
    blocks = [bytearray(n << 20) for n in (1, 3, 6, 8)]
    for b in blocks:
        b[::4096] = b"1" * len(range(0, len(b), 4096))
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _heap_rounds(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _HEAP_ROUNDS, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_workers_keep_freed_blocks_for_the_next_step_unless_the_user_tuned_malloc():
    applied, faults = _heap_rounds("keep")
    assert applied == "True" and faults < 100
    # glibc's defaults give the blocks back and fault them in again: 18 MiB a round, ~4,600 pages
    applied, faults = _heap_rounds("user-tuned")
    assert applied == "False" and faults > 10 * 2000
