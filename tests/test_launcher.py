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
