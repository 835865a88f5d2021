import json
import subprocess
import sys

import pytest

from pagedllm.benchmarks.report import account, agreement, weight_bytes_per_token

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
    assert agreement([[1, 2], [3]], [[1, 2], [4]]) == 2 / 3  # tokens repeated, up to each request's first difference
    assert agreement([[1, 2, 3, 4]], [[1, 5, 3, 4]]) == 1 / 4


def test_weight_bytes_per_token_are_the_projections_and_the_lm_head_of_the_saved_model(tiny_model):
    """The one-request bandwidth figure's numerator, against the tensors a real folder holds: every
    layer's projections at the weights' width (int4: half a byte) and the LM head in the model's
    dtype (tied: the embedding's matrix)."""
    from safetensors import safe_open

    from pagedllm.entrypoints.default_model import shipped_model_dir

    for folder in (tiny_model("llama"), shipped_model_dir()):  # untied; tied, 2 KV heads of 4
        with open(f"{folder}/config.json") as f:
            config = json.load(f)
        with safe_open(f"{folder}/model.safetensors", "pt") as f:
            sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        projections = sum(a * b for k, (a, b, *_) in ((k, v) for k, v in sizes.items() if "proj" in k))
        head = sizes.get("lm_head.weight", sizes["model.embed_tokens.weight"])
        assert weight_bytes_per_token(config, "float32") == 4 * (projections + head[0] * head[1])
        assert weight_bytes_per_token(config, "float32", "int4") == projections / 2 + 4 * head[0] * head[1]


def run_bench(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_memory_writes_json_and_plot(tmp_path):
    proc = run_bench("memory", "--num-prompts", "100", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["paged"] > data["contiguous_exact_length"] > data["contiguous_max_model_len"]
    placed = {r["placement"]: r for r in data["placements"]}
    assert set(placed) == {"lru", "first-fit", "best-fit"}
    assert all(r["mean_table_run"] >= 1 and 0 <= r["internal_waste"] < 1 for r in placed.values())
    assert (tmp_path / "kv_usage.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_peer_is_named():
    proc = run_bench("throughput", "--vs", "vllm-gpu", "--num-prompts", "2")
    assert proc.returncode == 2 and "--vs" in proc.stderr


def test_latency_sweep_writes_percentiles_and_plot(tiny_model, tmp_path):
    proc = run_bench(
        "latency", "--model", tiny_model("llama"), "--num-prompts", "6", "--rates", "4,16", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "latency.json").read_text())["rows"]
    assert [r["rate"] for r in rows] == [4.0, 16.0]
    for r in rows:
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert 0 <= r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_sweep(tiny_model, tmp_path):
    proc = run_bench(
        "scaling", "--model", tiny_model("llama"), "--num-prompts", "8", "--concurrency", "1,8", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert all(r["output_tok_s"] > 0 and r["seconds"] > 0 for r in rows)
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_serving_mode_runs_against_a_real_server(tiny_model, tmp_path):
    proc = run_bench(
        "serving",
        "--model",
        tiny_model("llama"),
        "--num-prompts",
        "4",
        "--rates",
        "8",
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "serving.json").read_text())
    assert [r["rate"] for r in data["rows"]] == [8.0, "inf"]
    requested = data["offline"]["output_tokens"]
    assert requested > 0 and all(r["output_tokens"] == requested for r in data["rows"])  # nothing lost
    assert data["served_over_offline"] > 0 and "served / best offline" in proc.stdout
    assert (tmp_path / "serving_latency.png").read_bytes()[:4] == b"\x89PNG"


FAKE_VLLM = """
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens
class _Completion:
    def __init__(self, ids): self.token_ids = ids
class _Output:
    def __init__(self, ids): self.outputs = [_Completion(ids)]
class LLM:
    def __init__(self, **kw): pass
    def generate(self, prompts, params, use_tqdm=False):
        with open("first_tokens.txt", "a") as f:  # in the peer's work folder
            f.write(" ".join(str(p[0]) for p in prompts) + "\\n")
        # a lazy engine: every request gets one token fewer than it asked for
        return [_Output([7] * (p.max_tokens - 1)) for p in params]
"""


def test_throughput_against_transformers_and_a_vllm_peer_through_its_own_interpreter(tiny_model, tmp_path):
    """One run against both peers: transformers' static batches, and vLLM through the
    interpreter of its own environment (a fake vLLM here, which returns a token short); one
    request, as the README's single-request command runs (each system's warm-up included), in
    two rounds: each round runs every system, the second's prompt starts with another token (no
    prefix is found cached), and the table counts each system's median."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids): return prompt_token_ids\n")
    python = tmp_path / "vllm-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    proc = run_bench(
        "throughput",
        "--model",
        tiny_model("llama"),
        "--num-prompts",
        "1",
        "--vs",
        "hf-static",
        "--vllm-python",
        str(python),
        "--rounds",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("round ")] == [
        "round 1/2",
        "round 2/2",
    ]
    assert "vllm" in proc.stdout.split("round 1/2")[1].split("\n")[0]  # vLLM's first round came before the second
    warm, first, second = (out / "vllm-work" / "first_tokens.txt").read_text().split("\n")[:3]
    assert warm == first != second and len(first.split()) == 1
    assert "transformers static batch 16" in proc.stdout and "pagedllm is" in proc.stdout
    assert "vLLM 0.0-fake (CPU)" in proc.stdout and "FLAGGED: 1 requests returned fewer tokens" in proc.stdout
    assert "start-up: pagedllm" in proc.stdout
    assert "weights read a token:" in proc.stdout and "of the probe's" in proc.stdout  # one request: its bandwidth
    data = json.loads((out / "throughput.json").read_text())
    assert data["weight_bytes_per_token"] > 0 and data["probe_gb_s"] > 0
    results = {r["name"]: r for r in data["results"]}
    assert data["results"][0]["name"] == "pagedllm (cpu)" and "transformers static batch 16" in results
    assert data["peer_versions"] == {"vllm": "0.0-fake"} and data["rounds"] == 2
    assert all(len(r["extra"]["round_seconds"]) == 2 for r in data["results"])
    median = sum(results["pagedllm (cpu)"]["extra"]["round_seconds"]) / 2
    assert results["pagedllm (cpu)"]["seconds"] == pytest.approx(median)
    assert [r["short_requests"] for r in data["results"] if r["name"].startswith("vLLM")] == [1]
    assert results["pagedllm (cpu)"]["short_requests"] == 0 == results["transformers static batch 16"]["short_requests"]
    # padded batches round differently, so long greedy paths may part at near-ties
    assert 0.0 <= results["transformers static batch 16"]["agreement"] <= 1.0
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = run_bench("throughput", "--vs", "vllm", "--num-prompts", "2")
    assert missing.returncode == 2 and "--vllm-python" in missing.stderr


def test_peak_flops_per_cycle_follows_the_vector_units_width():
    """Zen 4 runs AVX-512 on 256-bit pipes, Zen 5 and Intel's server cores on 512-bit ones."""
    from pagedllm.benchmarks.bench_decode_step import nominal_flops_per_cycle

    avx512 = {"fma", "avx2", "avx512f"}
    assert nominal_flops_per_cycle(avx512, "AuthenticAMD", 26) == 64  # Zen 5
    assert nominal_flops_per_cycle(avx512, "AuthenticAMD", 25) == 32  # Zen 4
    assert nominal_flops_per_cycle(avx512, "GenuineIntel", 6) == 64
    assert nominal_flops_per_cycle({"fma", "avx2"}, "AuthenticAMD", 23) == 32
    assert nominal_flops_per_cycle({"avx"}, "GenuineIntel", 6) == 16


def test_the_19m_models_word_tokenizer_covers_its_vocabulary(tmp_path):
    """vLLM refuses token ids past its tokenizer's vocabulary: the tokenizer saved beside the
    benchmark's 19M Llama has one word per id, and transformers reads it back as saved."""
    from transformers import AutoTokenizer

    from pagedllm.fixtures.tokenizers import save_word_tokenizer

    save_word_tokenizer(str(tmp_path), vocab_size=500)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 500 and tok.eos_token_id == 2
    assert tok("w3 w499 w77").input_ids == [3, 499, 77]
    assert tok.decode([3, 499, 77]) == "w3 w499 w77"


def test_rounds_wait_for_the_cpus_to_be_as_quiet_as_the_busy_processes_leave_them():
    """A round must not start beside the previous system's tail (a peer's spinning threads):
    wait_for_quiet waits out work beyond the expected busy processes, up to its timeout, and
    returns at once when only those run."""
    import os

    from pagedllm.benchmarks.machine import busy_processes, wait_for_quiet

    with busy_processes(1):
        assert wait_for_quiet(busy=0, timeout=0.6) >= 0.55  # a busy core is more than a quiet machine's
    # /proc/stat as a machine with one busy process and a tail that stops after two windows shows it
    cores, busy_share = os.cpu_count(), [1.9, 1.6, 1.0, 1.0]
    readings = iter([(0, 0)] + [(int(sum(busy_share[: i + 1]) * 100), 100 * cores * (i + 1)) for i in range(4)])
    waited = wait_for_quiet(busy=1, timeout=10.0, window=0.05, cpu_times=lambda: next(readings))
    assert 0.1 <= waited < 1.0  # three windows: two of the tail, then a quiet one


def test_the_speculative_bench_tells_quoting_from_looping():
    """bench_speculative's gain on its quoting workload is read beside what the outputs did: a
    5-gram of the prompt continued is a quote, one the output already wrote is a loop."""
    from pagedllm.benchmarks.bench_speculative import quoted_share

    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert quoted_share(prompt, [1, 2, 3, 4, 5, 6, 7]) == (3, 0)  # from its fifth token on
    assert quoted_share(prompt, [8, 9, 10, 11, 12, 8, 9, 10, 11, 12, 8]) == (0, 2)
    assert quoted_share(prompt, [7, 1, 2]) == (0, 0)
