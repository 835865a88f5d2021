"""The conformance suite on the cpu backend, on a third-party backend installed through its entry
point, and on deliberately broken backends, each of which must fail the right row."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.backends.platform import CONTRACT_VERSION
from pagedllm.backends.registry import UnknownBackend, available_backends, resolve
from pagedllm.conformance.results import format_table
from pagedllm.conformance.suite import run_suite


def failed_rows(results) -> dict[str, list[str]]:
    return {r.check: r.failures for r in results if not r.ok}


def test_cpu_backend_passes_the_quick_op_checks_and_prints_rows_as_they_finish(tmp_path):
    """Through the CLI. Each row is printed when its check ends, before the table, so a run cut
    short by a timeout (the GPU check's steps have them) has still shown what it did. The
    engine rows run below on an independent port (`example`); on the cpu backend the rest of
    the suite checks the same behaviour against transformers directly."""
    cmd = [sys.executable, "-m", "pagedllm.cli", "conformance", "--backend", "cpu", "--quick", "--ops-only", "--perf"]
    proc = subprocess.run([*cmd, "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 0 and report["ok"], proc.stdout
    names = [c["check"] for c in report["checks"]]
    assert {
        "write_kv",
        "decode_attention float32",
        "decode_attention bfloat16",
        "copy_blocks / swap_blocks",
        "argmax",
    } <= set(names)
    table_at = proc.stdout.index("pagedllm conformance — backend cpu")
    for name in names:
        assert 0 <= proc.stdout.find(f"  {name}: PASS (") < table_at, f"{name} was not printed as it finished"
    # the speed tier, beside the rows: decode attention per dtype and 8-bit KV cache, prefill
    # attention per dtype, each against what the machine measured in the same run
    speed = {(r["kernel"], r["dtype"], r["kv_cache_dtype"]): r for r in report["speed"]}
    assert ("decode attention", "bfloat16", "fp8_e4m3") in speed and ("prefill attention", "float32", "auto") in speed
    assert all(r["fraction"] > 0 and r["ms"] > 0 for r in speed.values())
    assert "speed tier — backend cpu (information, not a pass/fail)" in proc.stdout
    matrix = (tmp_path / "r.md").read_text()
    assert "| decode attention | float32 | auto |" in matrix and "| batch invariance | yes |" in matrix


def test_plugin_backend_is_found_and_passes(plugins_installed):
    """An out-of-tree port through its entry point: the whole quick suite, engine rows too."""
    specs = available_backends()
    assert "example" in specs and not specs["example"].builtin
    results = run_suite("example", quick=True)
    assert not failed_rows(results), format_table("example", results)
    names = {r.check for r in results}
    assert {"cache_placement", "preemption_swap", "fork_copy_on_write", "end_to_end_vs_transformers"} <= names


ATTENTION_FLOAT32 = {"decode_attention float32", "prefill_attention float32", "chunked_prefill_attention float32"}
ALL_DTYPES = ("float32", "bfloat16", "float16")


@pytest.mark.parametrize(
    "backend,rows,clue",
    [
        ("broken-slot-off-by-one", {"write_kv"}, "instead"),
        ("broken-no-softmax-scale", ATTENTION_FLOAT32 | {"shared_blocks"}, "off by"),
        ("broken-first-block-only", ATTENTION_FLOAT32 | {"shared_blocks"}, "context"),
        ("broken-split-k-combine", {f"decode_attention {d}" for d in ALL_DTYPES}, "long contexts"),
        ("broken-reused-chunk-buffer", {f"decode_attention {d}" for d in ALL_DTYPES}, "a batch of 96 requests"),
        ("broken-softmax-without-max", {f"large_scores {d}" for d in ALL_DTYPES}, "off by inf"),
        ("broken-argmax-last-of-ties", {"argmax"}, "want"),
        ("broken-lora-one-slot", {f"lora {d}" for d in ALL_DTYPES}, "(slots ["),
        ("broken-bitmask-last-word", {"token_bitmask"}, "differ from the mask"),
        ("broken-window-ignored", {f"sliding_window {d}" for d in ALL_DTYPES}, "window="),
        ("broken-soft-cap-ignored", {f"soft_cap {d}" for d in ALL_DTYPES}, "soft_cap="),
        ("broken-kv-scale-dropped", {f"kv_cache {f}" for f in ("fp8_e4m3", "fp8_e5m2", "int8")}, "attention off by"),
        ("broken-one-query-per-decode-row", {f"multi_token_decode {d}" for d in ALL_DTYPES}, "700 wrong at tokens [0"),
    ],
)
def test_broken_backends_fail_on_the_right_rows(plugins_installed, backend, rows, clue):
    """Each planted bug fails its rows, with a message that points at it, and nothing else."""
    results = run_suite(backend, quick=True, ops_only=True)
    failed = failed_rows(results)
    assert rows <= set(failed), format_table(backend, results)
    for row in rows:
        assert failed[row] and clue in failed[row][0], failed[row][0]
    if backend == "broken-slot-off-by-one":
        assert set(failed) == {"write_kv"}  # its attention ops are fine
        assert "should be at slot" in failed["write_kv"][0]
    elif backend == "broken-first-block-only":
        # contexts within one block are right; longer ones are not
        assert "context 1," not in failed["decode_attention float32"][0]
    elif backend != "broken-no-softmax-scale":
        # a bug that shows only past 1k tokens, past 64 requests or at large scores fails
        # nothing else: every other case is within what the broken port gets right
        # split-k's long decode rows sit in the speculative verification batch too
        also = {f"multi_token_decode {d}" for d in ALL_DTYPES} if backend == "broken-split-k-combine" else set()
        assert set(failed) == rows | also, format_table(backend, results)
        if backend == "broken-split-k-combine":
            assert all("long contexts" in f for f in failed["decode_attention float32"])


def test_the_windowed_end_to_end_row_passes_on_cpu_and_catches_a_kernel_ignoring_the_window(
    plugins_installed, tmp_path
):
    """The engine row for windows: the cpu backend passes it; a backend whose kernels read the
    whole context (released blocks included) fails it, at the first token that differs; a
    backend that does not declare windows skips it, saying why."""
    from pagedllm.backends.registry import load_backend
    from pagedllm.conformance.engine_checks import check_windowed_end_to_end

    passed = check_windowed_end_to_end("cpu", load_backend("cpu"), str(tmp_path), quick=True)
    assert passed.ok and passed.cases == 1 and not passed.skipped
    ignored = check_windowed_end_to_end(
        "broken-window-ignored", load_backend("broken-window-ignored"), str(tmp_path), True
    )
    assert not ignored.ok and "token" in ignored.failures[0] and "differs" in ignored.failures[0]
    skipped = check_windowed_end_to_end("example", load_backend("example"), str(tmp_path), quick=True)
    assert skipped.skipped and "supports_sliding_window" in skipped.skipped


def test_a_backend_is_checked_on_what_it_declares_and_refused_the_rest(plugins_installed, tiny_model):
    """The suite tests only the declared dtypes and sizes and prints them; a worker refuses a
    configuration outside them while starting (here in-process: what the worker process runs)."""
    from pagedllm.backends.worker import Worker
    from pagedllm.core.config import EngineConfig

    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "conformance", "--backend", "narrow-support", "--quick"]
        + ["--ops-only"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout
    assert "declared support: dtypes float32; block sizes 16; head sizes 16, 64; context lengths up to 512" in (
        proc.stdout
    )
    assert "bfloat16" not in proc.stdout.split("declared support")[1].split("\n", 1)[1]
    model = tiny_model("llama")
    for config, refusal in (
        (dict(block_size=32), r"block_size 32 \(supported: 16\)"),
        (dict(dtype="bfloat16"), r"dtype bfloat16 \(supported: float32\)"),
        (dict(max_model_len=1024), r"max_model_len 1024 \(contexts up to 512\)"),
        (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype fp8_e4m3 \(supported: auto, int8\)"),
    ):
        with pytest.raises(ValueError, match="backend narrow-support does not support " + refusal):
            Worker(EngineConfig(model=model, backend="narrow-support", **config))
    Worker(EngineConfig(model=model, backend="narrow-support", max_model_len=512))  # within: starts


def test_cli_exits_nonzero_on_failure_and_writes_json(plugins_installed, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "conformance",
            "--backend",
            "broken-no-softmax-scale",
            "--quick",
            "--ops-only",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "decode_attention float32" in proc.stdout
    assert f"contract version {CONTRACT_VERSION};" in proc.stdout  # the table's header: what it was written for
    assert '"ok": false' in out.read_text()
    # the support matrix beside it: what it declares, and per dtype what passed
    matrix = (tmp_path / "r.md").read_text()
    assert "## broken-no-softmax-scale" in matrix and f"contract version {CONTRACT_VERSION}" in matrix
    decode = next(line for line in matrix.splitlines() if line.startswith("| decode_attention |"))
    assert decode.count("FAIL") == 3, decode  # float32, bfloat16 and float16 all fail
    assert "| write_kv | pass" in matrix


def test_the_support_matrix_shows_backends_not_run_from_their_declarations():
    from pagedllm.conformance.matrix import installed_declarations, matrix

    page = matrix([], installed_declarations())
    assert "## cpu" in page and "host shared memory" in page
    for name in ("cuda-triton", "cuda-native"):  # importable here, never run: declarations only
        section = page.split(f"## {name}")[1].split("## ")[0]
        assert "Not yet run here" in section and "its own device memory" in section and "nccl" in section


def test_the_support_probe_writes_every_backends_features_as_csv(tmp_path):
    out = tmp_path / "support.csv"
    cmd = [sys.executable, "-m", "pagedllm.cli", "conformance", "--support", "--csv", str(out)]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0
    rows = {(r["backend"], r["feature"]): r for r in csv.DictReader(out.open())}
    assert rows["cpu", "batch invariance"]["supported"] == "yes"
    assert rows["cuda-triton", "batch invariance"]["supported"] == "no"  # promised only where the rows hold it
    assert rows["cpu", "kv cache int8"]["supported"] == "yes" and rows["cpu", "sliding window"]["supported"] == "yes"
    assert rows["cuda-native", "int4 weights"]["how"].startswith("base class")


def test_docs_backends_md_is_made_from_the_committed_cpu_run():
    """docs/backends.md is what the matrix makes of docs/bench/conformance-cpu.json (regenerate
    both with the commands the page names after changing a check or a declaration)."""
    from pagedllm.conformance.matrix import installed_declarations, matrix

    root = Path(__file__).resolve().parent.parent
    run = json.loads((root / "docs" / "bench" / "conformance-cpu.json").read_text())
    assert run["ok"] and run["speed"] and not run["quick"]
    assert matrix([run], installed_declarations()) == (root / "docs" / "backends.md").read_text()


def test_the_memory_tier_passes_on_cpu(tiny_model):
    from pagedllm.conformance.memory_checks import check_memory

    rows = check_memory("cpu", tiny_model("llama"), quick=False)
    assert [r.check for r in rows] == [
        "memory_pool_sized",
        "memory_every_block_used",
        "memory_nothing_left",
        "memory_worker_restart",
    ]
    assert all(r.ok and r.cases == 1 for r in rows), format_table("cpu", rows)


def test_unknown_backend_lists_known_ones():
    with pytest.raises(UnknownBackend, match=r"known backends: .*\bcpu\b"):
        resolve("nope")


def test_unavailable_backend_says_why(plugins_installed):
    from pagedllm import LLM
    from pagedllm.backends.registry import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="needs-hardware: no XPU device"):
        LLM(backend="needs-hardware")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "conformance", "--backend", "needs-hardware", "--ops-only"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "needs-hardware: no XPU device" in proc.stderr


def test_engine_row_failures_show_where_the_tokens_part():
    from pagedllm.conformance.engine_checks import _mismatches, first_difference

    assert first_difference([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 6, 7]) == (
        "token 4 differs: [3, 4, 5, 6, 7] vs expected [3, 4, 9, 6, 7] (tokens 2..)"
    )
    assert first_difference([1, 2], [1, 2, 3]).startswith("token 2 differs: [1, 2] vs expected [1, 2, 3]")
    (line,) = _mismatches("chunks", [[[1, 2]], [[5, 6, 7]]], [[[1, 2]], [[5, 8, 7]]], [[9], [9, 9]])
    assert line == "chunks: request 1 (prompt of 2 tokens): " + first_difference([5, 6, 7], [5, 8, 7])
