"""The runner against transformers running the same weights."""

import random

import pytest
import torch

from pagedllm.backends.cpu import native
from pagedllm.backends.cpu.packed_linear import native_bfloat16_matmul
from pagedllm.backends.runner import SeqInput
from pagedllm.fixtures.tiny_models import ARCHITECTURES, load_hf

from model_helpers import greedy_batched, hf_greedy, make_runner, shuffled_tables

ATOL = 1e-4


def random_prompt(n: int, seed: int, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_models(request, tiny_model):
    path = tiny_model(request.param)
    return request.param, path, load_hf(path)


def test_prefill_chunked_prefill_and_decode_logits(arch_models):
    arch, path, hf = arch_models
    runner = make_runner(path)
    prompt = random_prompt(70, seed=1)  # long enough for llama3 scaling to matter (orig. 64)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    (table,) = shuffled_tables(1, 8, 256, seed=3)

    whole = runner.execute([SeqInput(prompt, 0, table)])[0]
    assert (whole - ref[-1]).abs().max() <= ATOL

    # the same prompt in 3 chunked-prefill steps, into other blocks
    (table,) = shuffled_tables(1, 8, 256, seed=4)
    for start, end in ((0, 23), (23, 50), (50, 70)):
        logits = runner.execute([SeqInput(prompt[start:end], start, table)])[0]
        assert (logits - ref[end - 1]).abs().max() <= ATOL, f"chunk ending at {end}"

    # 32 decode steps after the chunked prefill
    tokens = list(prompt)
    worst = 0.0
    for _ in range(32):
        tokens.append(int(logits.argmax()))
        logits = runner.execute([SeqInput(tokens[-1:], len(tokens) - 1, table)])[0]
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0, -1]
        worst = max(worst, float((logits - expected).abs().max()))
    assert worst <= ATOL, f"{arch}: decode logits differ by {worst}"


def test_eight_prompts_in_one_batch_match_hf_generate_alone(arch_models):
    arch, path, hf = arch_models
    runner = make_runner(path)
    lengths = [1, 5, 15, 16, 17, 33, 48, 70]
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    ours = greedy_batched(runner, prompts, max_new=20, start_steps=[0, 0, 1, 1, 2, 3, 5, 8])
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 20), f"{arch}: prompt of {len(prompt)} tokens"


def bfloat16_runner_outputs(path: str):
    """Three prompts, the runner's bfloat16 greedy continuations of them (16 tokens), and its
    logits at each prompt's last position from a fresh prefill."""
    runner = make_runner(path, dtype="bfloat16")
    prompts = [random_prompt(n, seed=30 + n) for n in (4, 17, 40)]
    tokens = greedy_batched(runner, prompts, max_new=16)
    logits = []
    for prompt in prompts:
        (table,) = shuffled_tables(1, 4, 256, seed=5)
        logits.append(runner.execute([SeqInput(prompt, 0, table)])[0])
    return prompts, tokens, logits


def last_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_without_kernels_is_bit_identical_to_transformers_eager(tiny_model, arch, monkeypatch):
    """PAGEDLLM_CPU_KERNELS=0's path: rounds where transformers' eager bfloat16 rounds."""
    monkeypatch.setattr(native, "unavailable_reason", lambda: "off for this test")
    path = tiny_model(arch)
    hf = load_hf(path, dtype=torch.bfloat16)
    for prompt, got, logits in zip(*bfloat16_runner_outputs(path)):
        assert got == hf_greedy(hf, prompt, 16)
        assert torch.equal(logits, last_logits(hf, prompt))


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_on_the_widening_kernels_is_closer_to_float32_than_transformers_bfloat16(
    tiny_model, arch, float32_arithmetic
):
    """The widening kernels compute a bfloat16 model in float32 on its bfloat16 weights,
    rounding only the KV cache: against the same weights run in float32 by transformers, its
    logits must be near, and nearer than transformers' own bfloat16 computation (measured:
    about half its error or less), its greedy tokens equal. (The default on CPUs without
    bfloat16 arithmetic; PAGEDLLM_CPU_BF16_MATMUL=0 on the others.)"""
    errors = bfloat16_errors_against_float32(tiny_model(arch), same_greedy=True)
    for ours_err, hf16_err in errors:
        assert ours_err <= 0.1 and ours_err <= 0.6 * hf16_err, (ours_err, hf16_err)


@pytest.mark.skipif(not native_bfloat16_matmul(), reason="this CPU has no bfloat16 arithmetic for oneDNN")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_on_onednn_bfloat16_gemms_is_about_as_near_to_float32_as_transformers_bfloat16(tiny_model, arch):
    """Where the CPU multiplies bfloat16, the linear layers run oneDNN's bfloat16 GEMM on
    bfloat16-rounded inputs, as transformers' bfloat16 layers do, and attention (where the
    kernels were built for AVX-512 BF16) its dot products on a bfloat16-rounded query and
    probabilities; the rest stays float32. Its
    logits must be near float32's and about as near as transformers' bfloat16 (measured: 0.5-1.1x
    its error, per prompt). Its greedy tokens may part from float32's at a near-tie, as transformers'
    bfloat16 ones do."""
    for ours_err, hf16_err in bfloat16_errors_against_float32(tiny_model(arch)):
        assert ours_err <= 0.1 and ours_err <= 1.25 * hf16_err, (ours_err, hf16_err)


def bfloat16_errors_against_float32(path: str, same_greedy: bool = False) -> list[tuple[float, float]]:
    """Per prompt (three), the largest logit error of the runner in bfloat16 and of
    transformers' bfloat16, each against transformers running the same bfloat16 weights in
    float32; with same_greedy, asserts the runner's greedy tokens equal the float32 ones."""
    hf16 = load_hf(path, dtype=torch.bfloat16)
    hf32 = load_hf(path, dtype=torch.bfloat16).float()  # the bfloat16 weights, float32 arithmetic
    errors = []
    for prompt, got, logits in zip(*bfloat16_runner_outputs(path)):
        assert not same_greedy or got == hf_greedy(hf32, prompt, 16)
        exact, rounded = last_logits(hf32, prompt), last_logits(hf16, prompt)
        errors.append((float((logits - exact).abs().max()), float((rounded - exact).abs().max())))
    return errors


def test_a_mixed_steps_last_layer_runs_on_the_sampled_rows_alone_and_changes_no_logit(tiny_model):
    """Steps with a prefill take logits from one row per request, so the last layer projects and
    runs its MLP on those rows alone; the logits are those of the whole batch's hidden states."""
    from pagedllm.backends.runner import prepare_batch

    runner = make_runner(tiny_model("llama"))
    tables = shuffled_tables(5, 6, 256, seed=7)
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate((9, 30, 17, 40, 3))]
    runner.execute([SeqInput(p[:-1], 0, t) for p, t in zip(prompts[:3], tables)])  # three will decode
    seqs = [SeqInput(p[-1:], len(p) - 1, t) for p, t in zip(prompts[:3], tables)]
    seqs += [SeqInput(p, 0, t) for p, t in zip(prompts[3:], tables[3:])]  # two prefill
    seqs = [seqs[i] for i in (3, 0, 4, 2, 1)]  # requests in another order than the batch's rows
    batch = prepare_batch(seqs, runner.block_size)
    kv_before = runner.kv_caches.clone()
    with torch.no_grad():
        whole = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.ops)
        want = runner.model.compute_logits(whole[batch.logits_indices])
    kv_whole = runner.kv_caches.clone()
    runner.kv_caches.copy_(kv_before)
    got = runner.execute(seqs)
    assert torch.equal(runner.kv_caches, kv_whole)  # every token's K/V written all the same
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear", ["panel", "onednn"])
def test_float32_linear_layers_match_transformers_on_either_kernel(tiny_model, linear, monkeypatch):
    """float32 layers run the panel kernel on AVX2 CPUs and oneDNN's packed GEMM on AVX-512
    ones (model_kernels.panel_float32_linear): both forced here, a batch of prefills and decode
    steps against transformers' logits."""
    from pagedllm.backends.cpu import model_kernels, ops
    from pagedllm.backends.cpu.packed_linear import PackedLinear, packing_available

    if linear == "panel" and native.unavailable_reason() is not None:
        pytest.skip("compiled kernels unavailable")
    if linear == "onednn" and not packing_available(torch.float32):
        pytest.skip("oneDNN does not pack float32 weights here")
    monkeypatch.setattr(ops, "panel_float32_linear", lambda: linear == "panel")
    path = tiny_model("llama")
    hf = load_hf(path)
    runner = make_runner(path, "float32")
    want = model_kernels.PanelLinear if linear == "panel" else PackedLinear
    assert type(runner.model.layers[0].qkv_proj) is want and type(runner.model.lm_head) is want
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate((5, 33, 12))]
    tables = shuffled_tables(3, 4, 256, seed=9)
    logits = runner.execute([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    for _ in range(4):
        with torch.no_grad():
            expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        assert (logits - expected).abs().max() <= ATOL
        for p, row in zip(prompts, logits):
            p.append(int(row.argmax()))
        logits = runner.execute([SeqInput(p[-1:], len(p) - 1, t) for p, t in zip(prompts, tables)])
