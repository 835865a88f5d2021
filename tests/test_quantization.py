"""Weight quantization: the cpu kernels against the reference layer, the demo model's held-out
loss in each mode, GPTQ and AWQ checkpoints (packed here, in each format as its tools write
it) against transformers running the dequantized weights, and the refusals."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu import native
from pagedllm.backends.cpu.quantized_linear import CpuQuantizedLinear
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.models.parallel import TensorParallel
from pagedllm.backends.models.quantized import NF4_CODEBOOK, QuantizedLinear, QuantizedWeight, quantize
from pagedllm.benchmarks.bench_quantization import demo_held_out, held_out_loss, make_runner
from pagedllm.benchmarks.bench_quantization import greedy as in_process_greedy
from pagedllm.cli import build_parser
from pagedllm.core.errors import InvalidParameter
from pagedllm.entrypoints.cli import engine_kwargs
from pagedllm.entrypoints.default_model import shipped_model_dir
from pagedllm.entrypoints.engine_args import EngineArgs
from pagedllm.fixtures.tiny_models import load_hf

from model_helpers import hf_greedy

needs_kernels = pytest.mark.skipif(native.unavailable_reason() is not None, reason="no compiled cpu kernels here")


# --- the format and the quantizers ---


def test_round_to_nearest_errors_stay_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    int8 = quantize(w, "int8")
    assert ((int8.dequantize() - w).abs() <= int8.scales / 2 + 1e-7).all()
    int4 = quantize(w, "int4")
    assert int4.group_size == 128 and int4.scales.shape == (48, 2)
    step = int4.scales.repeat_interleave(128, 1)
    assert ((int4.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    nf4 = quantize(w, "nf4")
    book = torch.tensor(NF4_CODEBOOK)
    normalized = w / nf4.scales.repeat_interleave(64, 1)
    nearest = (normalized[..., None] - book).abs().argmin(-1)
    assert torch.equal(nf4.codes.long(), nearest)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("in_features", [256, 96, 40])  # groups of 128, 32 (fast path) and 40 (portable)
def test_cpu_kernel_equals_the_reference_layer(kind, in_features):
    torch.manual_seed(1)
    w = torch.randn(37, in_features) * 0.05
    reference = QuantizedLinear(quantize(w, kind), torch.randn(37))
    fast = CpuQuantizedLinear(reference)
    for rows in (1, 3, 6, 16, 40):  # blocks of 4 rows and their remainder; past 16: decoded to float32
        x = torch.randn(rows, in_features)
        expected = reference(x)
        assert (fast(x) - expected).abs().max() <= 1e-5 * expected.abs().max(), rows
    x = torch.randn(2, 5, in_features, dtype=torch.bfloat16)  # 16-bit in and out, float32 inside
    out = fast(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 37)
    assert (out.float() - reference(x.float())).abs().max() <= 0.02 * reference(x.float()).abs().max()


@needs_kernels
def test_act_order_weights_compute_with_their_channels_permuted():
    torch.manual_seed(2)
    k, group = 128, 32
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k)] = (torch.arange(k) // group).to(torch.int32)
    q = QuantizedWeight(
        "int4",
        torch.randint(0, 16, (24, k), dtype=torch.uint8),
        torch.rand(24, k // group) * 0.01,
        torch.randint(0, 16, (24, k // group)).float(),
        group,
        g_idx,
    )
    reference = QuantizedLinear(q, None)
    x = torch.randn(5, k)
    dense = (q.codes.float() - q.zeros[:, g_idx.long()]) * q.scales[:, g_idx.long()]
    assert torch.allclose(reference(x), x @ dense.t(), atol=1e-5)
    assert torch.allclose(CpuQuantizedLinear(reference)(x), x @ dense.t(), atol=1e-5)


# --- quality ---


@pytest.mark.skipif(not os.path.isfile(os.path.join(shipped_model_dir(), "config.json")), reason="no demo model")
def test_demo_model_held_out_loss_in_each_mode_stays_near_bfloat16():
    from transformers import AutoTokenizer

    demo = shipped_model_dir()
    chunks = demo_held_out(AutoTokenizer.from_pretrained(demo))[::3]  # a third of the set: 3,000 tokens
    base = held_out_loss(demo, "bfloat16", None, chunks)
    bounds = {"int8": 1.02, "int4": 1.08, "nf4": 1.08}
    losses = {mode: held_out_loss(demo, "bfloat16", mode, chunks) for mode in bounds}
    print(f"bfloat16 {base:.4f}; " + "; ".join(f"{m} {v:.4f} ({v / base - 1:+.2%})" for m, v in losses.items()))
    for mode, bound in bounds.items():
        assert losses[mode] <= bound * base, mode
    assert losses["int8"] != base  # the weights did change


# --- GPTQ and AWQ checkpoints ---

GROUP = 32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output column 8c + AWQ_PACK_ORDER[i]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 the checkpoints store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rtn_groups(w: torch.Tensor, groups_of_channel: torch.Tensor, num_groups: int):
    """Asymmetric 4-bit round-to-nearest per group of input channels: codes [N, K] and, per
    group, scales (float16, as saved) and zero points 1..15 (GPTQ's v1 format stores zero - 1)."""
    n, _ = w.shape
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, groups_of_channel == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        scales[g] = ((hi - lo) / 14).half().float()
        zeros[g] = (-lo / scales[g]).round().clamp(1, 15).long()
    s, z = scales[groups_of_channel].t(), zeros[groups_of_channel].t()
    codes = (w / s).round().long().add(z).clamp(0, 15)
    return codes, scales, zeros, (codes - z) * s  # the last: the weight the checkpoint stands for


def gptq_tensors(w: torch.Tensor, act_order: bool, seed: int):
    n, k = w.shape
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))] = torch.arange(k) // GROUP
    else:
        g_idx = torch.arange(k) // GROUP
    codes, scales, zeros, dense = rtn_groups(w, g_idx, k // GROUP)
    # qweight [K/8, N]: nibble j of row i is input channel 8i + j
    by_input = codes.t().reshape(k // 8, 8, n)
    qweight = sum(by_input[:, j] << (4 * j) for j in range(8))
    # qzeros [G, N/8]: nibble j of column c is output 8c + j, stored minus one
    stored = (zeros - 1).reshape(k // GROUP, n // 8, 8)
    qzeros = sum(stored[..., j] << (4 * j) for j in range(8))
    tensors = {"qweight": to_int32(qweight), "qzeros": to_int32(qzeros), "scales": scales.half()}
    tensors["g_idx"] = g_idx.to(torch.int32)
    return tensors, dense


def awq_tensors(w: torch.Tensor):
    n, k = w.shape
    codes, scales, zeros, dense = rtn_groups(w, torch.arange(k) // GROUP, k // GROUP)

    def pack_columns(values):  # [R, N] -> [R, N/8], interleaved
        v = values.reshape(values.shape[0], n // 8, 8)
        return to_int32(sum(v[..., AWQ_PACK_ORDER[i]] << (4 * i) for i in range(8)))

    return {"qweight": pack_columns(codes.t()), "qzeros": pack_columns(zeros), "scales": scales.half()}, dense


def write_quantized_checkpoint(source: str, out: str, reference: str, method: str, act_order: bool = False):
    """`out`: the model at `source` quantized and saved as `method` saves it; `reference`: the
    same model with each projection replaced by the weight its quantized form stands for."""
    hf = load_hf(source)
    state = hf.state_dict()
    saved = {}
    for i, layer in enumerate(hf.model.layers):
        for j, proj in enumerate(PROJECTIONS):
            stem = f"model.layers.{i}.{proj}"
            w = state.pop(f"{stem}.weight")
            if method == "gptq":
                # q/k/v and gate/up read the same input: one act order each (GPTQ's comes from that input)
                shares_input = {"self_attn.k_proj": 0, "self_attn.v_proj": 0, "mlp.up_proj": 4}
                tensors, dense = gptq_tensors(w, act_order, seed=10 * i + shares_input.get(proj, j))
                if f"{stem}.bias" not in state:
                    tensors["bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # GPTQ writes one regardless
            else:
                tensors, dense = awq_tensors(w)
            saved.update({f"{stem}.{name}": t for name, t in tensors.items()})
            layer.get_submodule(proj).weight.data.copy_(dense)
    hf.save_pretrained(reference)
    if "lm_head.weight" in state and hf.config.tie_word_embeddings:
        del state["lm_head.weight"]
    os.makedirs(out, exist_ok=True)
    tensors = {**state, **saved}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qc}, f)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            with open(os.path.join(source, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
    return out, reference


PROMPTS = [[5, 17, 33, 99], [250, 3, 8, 8, 120, 7, 64], [42]]


@pytest.fixture(scope="module")
def gptq_act_order(tiny_model, tmp_path_factory):
    source = tiny_model("qwen2", hidden_size=128, intermediate_size=256)  # with q/k/v biases
    root = tmp_path_factory.mktemp("gptq")
    return write_quantized_checkpoint(source, str(root / "q"), str(root / "ref"), "gptq", act_order=True)


@pytest.fixture(scope="module")
def awq(tiny_model, tmp_path_factory):
    source = tiny_model("llama", hidden_size=128, intermediate_size=256)
    root = tmp_path_factory.mktemp("awq")
    return write_quantized_checkpoint(source, str(root / "q"), str(root / "ref"), "awq")


def greedy(path: str, **engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, skip_tokenizer_init=True, **engine) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_gptq_act_order_checkpoint_generates_what_transformers_does_with_its_dequantized_weights(gptq_act_order):
    quantized, reference = gptq_act_order
    hf = load_hf(reference)
    assert greedy(quantized) == [hf_greedy(hf, p, 24) for p in PROMPTS]
    with pytest.raises(ValueError, match="act-order"):  # its input channels cannot be split by group
        load_model(quantized, tp=TensorParallel(rank=1, size=2))


def test_awq_checkpoint_equals_transformers_and_splits_by_group_over_two_ranks(awq):
    quantized, reference = awq
    hf = load_hf(reference)
    expected = [hf_greedy(hf, p, 24) for p in PROMPTS]
    assert greedy(quantized) == expected
    assert greedy(quantized, tensor_parallel_size=2) == expected


def test_load_time_int8_over_two_ranks_equals_one_rank(tiny_model):
    """Each rank quantizes its own slice; a row-parallel slice's int8 scales come from its whole
    row (without that all-reduce the ranks' scales differ and so do the tokens)."""
    path = tiny_model("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    one_rank = in_process_greedy(make_runner(path, "float32", "int8", 64), PROMPTS, 24)
    assert greedy(path, quantization="int8", tensor_parallel_size=2) == one_rank


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_expert_projections_quantize_and_compute_with_their_dequantized_weights(tiny_model, kind):
    """A Mixtral quantized at load: every expert's projections become quantized layers (the
    cpu kernels), and its logits are those of the float model holding the dequantized weights."""
    path = tiny_model("mixtral", sliding_window=None, intermediate_size=64)
    quantized = load_model(path, quantization=kind)
    reference = load_model(path)
    with torch.no_grad():
        for q, ref in zip(quantized.layers, reference.layers):
            for name in ("qkv_proj", "o_proj"):
                getattr(ref, name).weight.copy_(getattr(q, name).weight.dequantize(torch.float32))
            for e, (gate_up, down) in enumerate(zip(q.experts.gate_up, q.experts.down)):
                ref.experts.w13[e].copy_(gate_up.weight.dequantize(torch.float32))
                ref.experts.w2[e].copy_(down.weight.dequantize(torch.float32))
    runner = make_runner(path, "float32", kind, 64)
    assert all(isinstance(m, CpuQuantizedLinear) for m in runner.model.layers[0].experts.gate_up)
    ours = in_process_greedy(runner, PROMPTS, 12)
    from pagedllm.backends.cpu import CpuAttentionOps
    from pagedllm.backends.runner import ModelRunner, allocate_kv_caches

    ref_runner = ModelRunner(reference, CpuAttentionOps(), allocate_kv_caches(reference, 64, 16), 16)
    assert ours == in_process_greedy(ref_runner, PROMPTS, 12)


def test_load_time_int8_experts_over_two_ranks_equal_one_rank(tiny_model):
    """Each rank quantizes its slice of every expert; the down projections' row scales come from
    the whole row."""
    path = tiny_model("mixtral", sliding_window=None, intermediate_size=64)
    one_rank = in_process_greedy(make_runner(path, "float32", "int8", 64), PROMPTS, 24)
    assert greedy(path, quantization="int8", tensor_parallel_size=2) == one_rank


def test_quantized_checkpoints_load_as_codes_without_a_full_precision_copy(awq):
    model = load_model(awq[0])
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            proj = getattr(layer, name)
            assert isinstance(proj, QuantizedLinear) and proj.codes.dtype == torch.uint8 and proj.group_size == GROUP
            assert not [p for p in proj.parameters() if p.dim() > 1]
    assert model.layers[0].gate_up_proj.codes.shape == (512, 128)


# --- choosing a mode, and the refusals ---


def test_the_flag_reaches_the_engine_on_generate_serve_and_bench():
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "--quantization", "int4", "hi"]))["quantization"] == "int4"
    assert engine_kwargs(parser.parse_args(["serve", "--quantization", "nf4"]))["quantization"] == "nf4"
    assert parser.parse_args(["bench", "throughput", "--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--quantization", "int3", "hi"])


def test_refusals_name_the_problem(tiny_model, awq, tmp_path):
    plain = tiny_model("llama")
    assert EngineArgs(model=plain, quantization="int8").engine_config().quantization == "int8"
    assert EngineArgs(model=awq[0]).engine_config().quantization == "awq"  # the checkpoint's own method
    with pytest.raises(InvalidParameter, match="already quantized with awq"):
        EngineArgs(model=awq[0], quantization="int4").engine_config()
    with pytest.raises(InvalidParameter, match="needs a checkpoint saved by gptq"):
        EngineArgs(model=plain, quantization="gptq").engine_config()
    with pytest.raises(InvalidParameter, match="not one of"):
        EngineArgs(model=plain, quantization="int3").engine_config()
    for qc, message in (
        ({"quant_method": "fp8"}, "quantized with 'fp8'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM"),
    ):
        folder = tmp_path / qc["quant_method"]
        folder.mkdir(exist_ok=True)
        with open(os.path.join(plain, "config.json")) as f:
            config = json.load(f)
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(InvalidParameter, match=message):
            EngineArgs(model=str(folder)).engine_config()
