import json
import subprocess
import sys

from pagedllm.benchmarks.report import account, agreement

PROMPTS = [[5, 6], [7, 8, 9]]


def test_accounting_counts_only_requested_tokens_and_flags_short_outputs():
    honest = account("honest", 1.0, PROMPTS, [3, 2], [[1, 2, 3], [4, 5]])
    assert honest.useful_tokens == 5 and honest.short_requests == 0
    padded = account("padded", 1.0, PROMPTS, [3, 2], [[1, 2, 3, 9, 9], [4, 5, 9]])
    assert padded.useful_tokens == 5, "tokens beyond what was asked must not count"
    lazy = account("lazy", 1.0, PROMPTS, [3, 2], [[1], [4, 5]])
    assert lazy.useful_tokens == 3 and lazy.short_requests == 1
    missing = account("missing", 1.0, PROMPTS, [3, 2], [[1, 2, 3]])
    assert missing.short_requests == 1
    assert agreement([[1, 2], [3]], [[1, 2], [4]]) == 0.5


def run_bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_throughput_writes_table_json_and_png(tiny_model, tmp_path):
    proc = run_bench("throughput", "--model", tiny_model("llama"), "--num-prompts", "4", "--vs", "hf-static",
                     "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "transformers static batch 16" in proc.stdout and "pagedllm is" in proc.stdout
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert [r["name"] for r in data["results"]] == ["pagedllm (cpu)", "transformers static batch 16"]
    assert all(r["short_requests"] == 0 for r in data["results"])
    # padded batches round differently, so long greedy paths may part at near-ties
    assert 0.0 <= data["results"][1]["agreement"] <= 1.0
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_writes_json_and_plot(tmp_path):
    proc = run_bench("memory", "--num-prompts", "100", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["paged"] > data["contiguous_exact_length"] > data["contiguous_max_model_len"]
    assert (tmp_path / "kv_usage.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_peer_is_named():
    proc = run_bench("throughput", "--vs", "vllm-gpu", "--num-prompts", "2")
    assert proc.returncode == 2 and "--vs" in proc.stderr


def test_latency_sweep_writes_percentiles_and_plot(tiny_model, tmp_path):
    proc = run_bench("latency", "--model", tiny_model("llama"), "--num-prompts", "6", "--rates", "4,16",
                     "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "latency.json").read_text())["rows"]
    assert [r["rate"] for r in rows] == [4.0, 16.0]
    for r in rows:
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert 0 <= r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_sweep(tiny_model, tmp_path):
    proc = run_bench("scaling", "--model", tiny_model("llama"), "--num-prompts", "8", "--concurrency", "1,8",
                     "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert all(r["output_tok_s"] > 0 and r["seconds"] > 0 for r in rows)
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
