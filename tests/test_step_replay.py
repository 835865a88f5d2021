"""The cpu backend's replayed decode steps (backends/cpu/step_replay.py) must compute what the
eager step computes, bit for bit — logits and the K/V written — in float32 and 16-bit, and be
left out where a step is not all compiled kernels."""

import pytest
import torch

from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.cpu.forward_recorder import record_forward
from pagedllm.backends.cpu.step_replay import StepReplay
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.entrypoints.default_model import shipped_model_dir
from pagedllm.fixtures.tiny_models import ARCHITECTURES, MORE_ARCHITECTURES, make_model_dir

BLOCK = 16


def runner_and_replay(dtype: str, quantization=None, max_batch: int = 8, window=None):
    model = load_model(shipped_model_dir(), dtype=dtype, quantization=quantization)
    if window:  # as a Mistral-style model's layers have it
        for layer in model.layers:
            layer.window, layer.attn_options = window, {"window": window}
    kv = allocate_kv_caches(model, 64, BLOCK)
    ops = CpuAttentionOps()
    runner = ModelRunner(model, ops, kv, BLOCK)
    return runner, ops.capture_graphs(model, kv, BLOCK, max_batch, 512)


@pytest.mark.parametrize(
    "dtype,window,float32_linears",
    [("float32", None, "panel"), ("float32", None, "onednn"), ("bfloat16", None, None), ("float32", 21, None)],
)
def test_a_replayed_decode_step_equals_the_eager_one(dtype, window, float32_linears, monkeypatch):
    """float32 layers run on the panel kernel or on oneDNN by the CPU (model_kernels'
    panel_float32_linear): both are replayed, whichever this machine picks."""
    from pagedllm.backends.cpu import ops, packed_linear

    if float32_linears == "onednn" and not packed_linear.packing_available(torch.float32):
        pytest.skip("oneDNN does not pack float32 weights here")
    if float32_linears == "panel" and not {"avx2", "fma"} <= ops.native.cpu_flags():
        pytest.skip("the panel kernel needs AVX2 with FMA")
    if float32_linears:
        monkeypatch.setattr(ops, "panel_float32_linear", lambda: float32_linears == "panel")
    runner, replay = runner_and_replay(dtype, window=window)
    kinds = {type(layer.qkv_proj).__name__ for layer in runner.model.layers}
    assert float32_linears is None or kinds == {"PanelLinear" if float32_linears == "panel" else "PackedLinear"}
    assert isinstance(replay, StepReplay)
    # on oneDNN's GEMMs the kernels after each read its product in place (in bfloat16 on CPUs that
    # multiply bfloat16: the step stays in bfloat16 between them)
    on_onednn = {"Bfloat16Linear": torch.bfloat16, "PackedLinear": torch.float32}
    assert replay.products_in_place == (on_onednn.get(kinds.pop()) if len(kinds) == 1 else None)
    prompts = [list(range(10, 10 + n)) for n in (1, 15, 16, 130)]  # contexts across block edges
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    runner.execute([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    before = runner.kv_caches.clone()
    for batch in ([0, 1, 2, 3], [3], [2, 0]):  # one set of buffers serves every batch size
        seqs = [SeqInput([5 + i], len(prompts[i]), tables[i]) for i in batch]
        runner.kv_caches.copy_(before)
        runner.replay = None
        eager = runner.execute(seqs)
        eager_kv = runner.kv_caches.clone()
        runner.kv_caches.copy_(before)
        runner.replay = replay
        assert replay.fits(seqs)
        assert torch.equal(runner.execute(seqs), eager)
        assert torch.equal(runner.kv_caches, eager_kv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_chunks_equal_eager_ones_and_give_every_rows_hidden_state(dtype):
    """Several tokens a request (prefills, a chunk after a cached prefix, speculative
    decoding's verification): a row a token, each at its own position, the buffers grown past
    max_batch on first need; the same logits, K/V and, where rows' hidden states are asked for
    (all of a chunk's, or the first few of a prefill's), the same hidden states."""
    runner, replay = runner_and_replay(dtype, max_batch=8)
    tables = [list(range(1, 11)), list(range(11, 21)), list(range(21, 31))]
    steps = [
        [SeqInput(list(range(5, 38)), 0, tables[0]), SeqInput(list(range(7, 12)), 0, tables[1])],
        [SeqInput(list(range(40, 47)), 33, tables[0]), SeqInput([9], 5, tables[1])],
        [SeqInput([3] * 150, 0, tables[2]), SeqInput([8, 9], 6, tables[1])],
    ]
    before = runner.kv_caches.clone()
    results = {}
    for graphs in (None, replay):
        runner.kv_caches.copy_(before)
        runner.replay = graphs
        outs = [runner.execute(steps[0]), runner.execute_with_hidden(steps[1], {0: 7, 1: 1})]
        outs.append(runner.execute_with_hidden(steps[2], {0: 20}))
        results[graphs is None] = (outs, runner.kv_caches.clone())
    (eager, eager_kv), (replayed, replayed_kv) = results[True], results[False]
    assert replay.capacity >= 152 > replay.max_batch
    assert torch.equal(eager[0], replayed[0]) and torch.equal(eager[1][0], replayed[1][0])
    assert all(torch.equal(eager[1][1][i], replayed[1][1][i]) for i in (0, 1))
    assert torch.equal(eager[2][0], replayed[2][0]) and torch.equal(eager[2][1][0], replayed[2][1][0])
    assert torch.equal(eager_kv, replayed_kv)


def test_a_replayed_step_refuses_a_token_outside_the_embedding_and_a_slot_outside_the_cache():
    """The step program checks what it gathers and where it writes, as torch's embedding and the
    eager write_kv do: an IndexError naming the table, and the K/V cache untouched."""
    runner, replay = runner_and_replay("float32")
    vocab = runner.model.config.vocab_size
    runner.replay = replay
    before = runner.kv_caches.clone()
    with pytest.raises(IndexError, match=f"a token id outside the embedding's {vocab} rows"):
        replay.run([SeqInput([vocab], 0, [1])])
    with pytest.raises(IndexError, match="write_kv: a slot outside the cache's"):
        replay.run([SeqInput([5], 0, [64])])  # block 64 of a 64-block pool
    assert torch.equal(runner.kv_caches, before)
    runner.execute([SeqInput([5, 6], 0, [1])])  # and it goes on


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_steps_in_one_call_choose_what_the_runner_and_argmax_choose(quantization):
    """A decode run's greedy steps whole in compiled code (StepReplay.greedy_step: the step, the
    LM head and argmax, the next step's inputs moved on in place) against the runner's logits
    and argmax step by step: the same tokens and the same K/V, across a block edge."""
    runner, replay = runner_and_replay("float32", quantization=quantization)
    if not replay.greedy_fits(3):
        pytest.skip("this machine's float32 layers are not on the panel kernel")
    prompts = [list(range(10, 24)), [7, 8, 9], list(range(30, 60))]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    runner.replay = replay  # the prefill's 47 rows grow its buffers, under the runner's inference mode
    runner.execute([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    assert replay.capacity >= 47
    before = runner.kv_caches.clone()
    first = [5, 6, 7]

    def step_by_step():
        tokens, last = [], first
        for k in range(6):
            seqs = [SeqInput([last[i]], len(prompts[i]) + k, tables[i]) for i in range(3)]
            last = torch.argmax(runner.execute(seqs), dim=-1).tolist()
            tokens.append(last)
        return tokens

    want = step_by_step()
    want_kv = runner.kv_caches.clone()
    runner.kv_caches.copy_(before)
    seqs = [SeqInput([first[i]], len(prompts[i]), tables[i]) for i in range(3)]
    got = [replay.greedy_step(seqs, 2).tolist()] + [replay.greedy_step(None, 2).tolist() for _ in range(5)]
    assert got == want
    assert torch.equal(runner.kv_caches, want_kv)
    with pytest.raises(IndexError, match="no block in its table"):  # row 0's blocks end at position 47
        for _ in range(48):
            replay.greedy_step(None, 2)


def test_what_a_replay_does_not_take():
    replay = runner_and_replay("float32", max_batch=2)[1]
    table = list(range(1, 11))
    assert replay.fits([SeqInput([1, 2, 3], 0, table)])  # a prefill: a row a token, more than max_batch
    assert replay.fits([SeqInput([1], 3, table)] * replay.row_cap)
    assert not replay.fits([SeqInput([1], 3, table)] * (replay.row_cap + 1))  # more rows than it grows to
    assert not replay.fits([SeqInput([1], 512, table)])  # past the captured context
    _, quantized = runner_and_replay("bfloat16", quantization="int8")
    assert quantized is None  # quantized layers round their float32 products to bfloat16: eager steps


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_float32_model_replays_with_the_eager_bits(quantization):
    """Weight-only quantized layers replay as their forward runs them: the GEMV up to 16 rows,
    oneDNN's GEMM on the decoded weights past that (a 40-token chunk); logits and K/V equal."""
    runner, replay = runner_and_replay("float32", quantization=quantization)
    assert isinstance(replay, StepReplay)
    tables = [list(range(1, 11)), list(range(11, 21)), list(range(21, 31))]
    steps = [
        [SeqInput(list(range(5, 45)), 0, tables[0]), SeqInput(list(range(7, 12)), 0, tables[1])],
        [SeqInput([9], 40, tables[0]), SeqInput([8], 5, tables[1]), SeqInput([3, 4], 0, tables[2])],
    ]
    before = runner.kv_caches.clone()
    results = []
    for graphs in (None, replay):
        runner.kv_caches.copy_(before)
        runner.replay = graphs
        results.append(([runner.execute(step) for step in steps], runner.kv_caches.clone()))
    (eager, eager_kv), (replayed, replayed_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    assert torch.equal(eager_kv, replayed_kv)


@pytest.mark.parametrize("arch", ARCHITECTURES + MORE_ARCHITECTURES)
def test_the_replay_is_the_eager_pass_recorded_or_none(arch, tmp_path_factory):
    """The replay's steps are recorded from the eager forward pass (forward_recorder.py): a model
    whose pass computes outside the steps the replay binds (a q/k norm, sandwich norms, soft
    caps, experts, a scaled embedding, a second rotary table) runs eagerly; every other one
    replays bit for bit."""
    path = make_model_dir(str(tmp_path_factory.mktemp(arch)), arch)
    model = load_model(path, dtype="float32")
    kv = allocate_kv_caches(model, 40, BLOCK)
    ops = CpuAttentionOps()
    runner = ModelRunner(model, ops, kv, BLOCK)
    replay = ops.capture_graphs(model, runner.layer_caches, BLOCK, 4, 256)
    expected_eager = {"qwen3", "gemma2", "gemma3", "mixtral", "qwen3-moe"}
    assert (replay is None) == (arch in expected_eager), arch
    if replay is None:
        return
    steps = record_forward(model, runner.layer_caches)
    assert [s.kind for s in steps[:10]] == [
        "norm",
        "linear",
        "rotate",
        "write_kv",
        "attend",
        "linear",
        "norm",
        "linear",
        "act",
        "linear",
    ]
    assert len(steps) == 10 * len(model.layers) + 1 and steps[-1].kind == "norm"
    prompts = [list(range(10, 10 + n)) for n in (1, 17, 40)]
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    seqs = [SeqInput(p, 0, t) for p, t in zip(prompts, tables)]
    before = runner.kv_caches.clone()
    outs = []
    for graphs in (None, replay):
        runner.kv_caches.copy_(before)
        runner.replay = graphs
        first = runner.execute(seqs)
        decode = runner.execute([SeqInput([5], len(p), t) for p, t in zip(prompts, tables)])
        outs.append((first, decode, runner.kv_caches.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_a_backend_built_on_the_cpu_one_keeps_its_own_decode_ops():
    """A port (or a planted bug) that overrides decode attention must run it: no replay."""

    class OwnAttention(CpuAttentionOps):
        def decode_attention(self, query, kv_cache, meta, scale):
            return super().decode_attention(query, kv_cache, meta, scale)

    model = load_model(shipped_model_dir(), dtype="float32")
    kv = allocate_kv_caches(model, 8, BLOCK)
    ops = OwnAttention()
    ModelRunner(model, ops, kv, BLOCK)
    assert ops.capture_graphs(model, kv, BLOCK, 4, 128) is None
    assert CpuAttentionOps().capture_graphs(model, kv, BLOCK, 4, 128) is not None


@pytest.mark.parametrize("threads", [1, 2])
def test_each_rows_attention_is_the_rows_own_whatever_the_batch(threads):
    """The compiled attention kernel hands a thread a few rows at a time; every row's output is
    bit for bit the one it gets alone (a replayed step mixing chunks and decodes groups rows
    unlike the eager one). The kernel's prefetcher once changed how GCC compiled the row loops
    it sat in, so the first row of each group came out a few ulps off."""
    ops = CpuAttentionOps()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 40, BLOCK, 2, 64, generator=gen)
    q = torch.randn(8, 4, 64, generator=gen)
    tables = torch.stack([torch.randperm(39, generator=gen)[:10] + 1 for _ in range(8)]).int()
    ctx = torch.tensor([37, 100, 5, 150, 60, 33, 90, 17], dtype=torch.int32)

    def attend(rows):
        return ops.decode_attention(q[rows], kv, DecodeMetadata(tables[rows], ctx[rows], int(ctx[rows].max())), 0.125)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = attend(list(range(8)))
        assert all(torch.equal(batch[r], attend([r])[0]) for r in range(8))
    finally:
        torch.set_num_threads(before)


def test_onednn_sees_row_counts_padded_to_a_multiple_of_8_and_the_padding_is_cut_off(monkeypatch):
    """oneDNN builds a primitive for every row count it has not seen (~0.4 ms each): layers on
    it, eager and replayed, run at most 32 counts up to 256 rows; larger ones as they are."""
    from torch import nn

    from pagedllm.backends.cpu import packed_linear, step_replay
    from pagedllm.backends.cpu.model_kernels import Bfloat16Linear

    seen, gemm = [], packed_linear.packed_linear

    def recording(x, packed, bias):
        seen.append(x.shape[0])
        return gemm(x, packed, bias)

    layers = []
    if packed_linear.packing_available(torch.float32):
        layers.append((packed_linear.PackedLinear(nn.Linear(48, 40)), torch.float32))
    if packed_linear.native_bfloat16_matmul():
        layers.append((Bfloat16Linear(nn.Linear(48, 40, dtype=torch.bfloat16)), torch.bfloat16))
    if not layers:
        pytest.skip("oneDNN packs neither float32 nor bfloat16 weights here")
    monkeypatch.setattr(packed_linear, "packed_linear", recording)
    x = torch.randn(300, 48)
    for layer, dtype in layers:
        for rows in (1, 7, 8, 9, 63, 256, 257, 300):
            seen.clear()
            got = layer(x[:rows])
            assert seen == [packed_linear.padded_rows(rows)] == [rows if rows > 256 else -(-rows // 8) * 8]
            assert got.shape == (rows, 40)
            want = gemm(x[:rows].to(dtype), layer.packed, layer.bias).float()
            torch.testing.assert_close(got.float(), want)
    if not packed_linear.native_bfloat16_matmul():
        return
    runner, replay = runner_and_replay("bfloat16", max_batch=12)
    runner.execute([SeqInput([3, 4, 5], 0, [1]), SeqInput([8, 9], 0, [2])])
    monkeypatch.setattr(step_replay, "packed_linear", recording)
    seen.clear()
    replay.run([SeqInput([6], 3, [1]), SeqInput([7], 2, [2])])
    assert len(seen) == 4 * len(runner.model.layers) and set(seen) == {8}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replay_keeps_rows_for_any_mix_of_decodes_verifications_chunks_and_prompt_logprob_rows(dtype):
    """Random steps mixing decodes, verifications (every row kept), prefill chunks and prompt
    logprobs over part or all of a chunk: a step may keep more rows than it computes (a
    verification's or a whole chunk's last row is kept twice, as its sequence's last and as a
    wanted row), and its buffers may start smaller than either count. Logits, wanted hidden
    states and K/V equal the eager step's, bit for bit."""
    import random

    rng = random.Random(7)
    # first the mixes that once overran the buffers (a step's rows exactly fill them): one full
    # verification (k=7 at max_num_seqs=8); three decodes beside a k=4 verification; prompt
    # logprobs over a whole 64-token chunk; then random mixes
    fixed = [(8, [("verify", 8)]), (8, [("decode", 1)] * 3 + [("verify", 5)]), (64, [("logprob chunk", 64)])]
    kinds = ["decode", "verify", "chunk", "logprob chunk"]
    for trial in range(16):
        if trial < len(fixed):
            max_batch, mix = fixed[trial]
        else:
            max_batch = rng.choice([1, 2, 4, 8])
            mix = [(kind, None) for kind in rng.choices(kinds, k=rng.randrange(1, 7))]
        runner, replay = runner_and_replay(dtype, max_batch=max_batch)
        seqs, wanted = [], {}
        for i, (kind, n) in enumerate(mix):
            start = rng.randrange(0 if "chunk" in kind else 1, 40)
            n = n or {"decode": 1, "verify": rng.randrange(2, 9)}.get(kind) or rng.randrange(2, 30)
            table = list(range(1 + 7 * i, 8 + 7 * i))
            seqs.append(SeqInput([rng.randrange(5, 390) for _ in range(n)], start, table))
            if kind == "verify":
                wanted[i] = n
            elif kind == "logprob chunk":
                wanted[i] = rng.choice([n, rng.randrange(1, n + 1)])
        runner.kv_caches.normal_(generator=torch.Generator().manual_seed(trial))
        before = runner.kv_caches.clone()
        results = []
        for graphs in (None, replay):
            runner.kv_caches.copy_(before)
            runner.replay = graphs
            assert graphs is None or graphs.fits(seqs)
            logits, rows = runner.execute_with_hidden(seqs, wanted)
            results.append((logits, rows, runner.kv_caches.clone()))
        (eager, eager_rows, eager_kv), (replayed, replayed_rows, replayed_kv) = results
        case = f"trial {trial}: {[(len(s.token_ids), s.start_pos) for s in seqs]}, wanted {wanted}"
        assert torch.equal(eager, replayed), case
        assert eager_rows.keys() == replayed_rows.keys() and all(
            torch.equal(eager_rows[i], replayed_rows[i]) for i in wanted
        ), case
        assert torch.equal(eager_kv, replayed_kv), case


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_under_adapters_replay_with_the_eager_bits(dtype):
    """Each row adds its adapter slot's product after every adapted linear layer (the compiled
    kernel up to 64 rows, torch's GEMMs past them, as the eager step chooses): decodes in mixed
    slots and none, a 100-token prefill beside a chunk with its rows' hidden states kept."""
    from pagedllm.backends.lora import LoRASlots

    model = load_model(shipped_model_dir(), dtype=dtype)
    ops = CpuAttentionOps()
    kv = allocate_kv_caches(model, 64, BLOCK)
    runner = ModelRunner(model, ops, kv, BLOCK)  # the backend prepares the model, then the adapters wrap it
    runner.lora = slots = LoRASlots(model, ops, shipped_model_dir(), max_loras=2, max_rank=16, max_cpu_loras=None)
    gen = torch.Generator().manual_seed(0)
    for key in slots.a:
        slots.a[key].normal_(std=0.05, generator=gen)
        slots.b[key].normal_(std=0.05, generator=gen)
    slots.scales.copy_(torch.tensor([2.0, 0.5]))
    replay = ops.capture_graphs(model, kv, BLOCK, 8, 512)
    assert isinstance(replay, StepReplay) and any(s.kind == "lora" for s in replay.steps)
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(4)]
    decodes = [SeqInput([5 + i], 20 + i, tables[i], lora_slot=[0, -1, 1, 0][i]) for i in range(4)]
    prefill = [SeqInput([7] * 100, 0, tables[0], lora_slot=1), SeqInput(list(range(9, 30)), 4, tables[1], lora_slot=0)]
    runner.kv_caches.normal_(generator=gen)
    before = runner.kv_caches.clone()
    results = []
    for graphs in (None, replay):
        runner.kv_caches.copy_(before)
        runner.replay = graphs
        plain = runner.execute([SeqInput([5], 20, tables[0])])
        results.append((runner.execute(decodes), runner.execute_with_hidden(prefill, {1: 21}), plain))
        results[-1] += (runner.kv_caches.clone(),)
    (eager, eager_prefill, eager_plain, eager_kv), (replayed, replayed_prefill, replayed_plain, replayed_kv) = results
    assert torch.equal(eager, replayed) and torch.equal(eager_plain, replayed_plain)
    assert torch.equal(eager_prefill[0], replayed_prefill[0]) and torch.equal(
        eager_prefill[1][1], replayed_prefill[1][1]
    )
    assert torch.equal(eager_kv, replayed_kv)
    assert not torch.equal(eager[0], eager_plain[0])  # the adapter changed the logits
    if replay.greedy_fits(len(decodes)):  # a decode run's step, whole in one compiled call
        runner.kv_caches.copy_(before)
        runner.execute([SeqInput([5], 20, tables[0])])
        chosen = replay.greedy_step(decodes, torch.get_num_threads())
        assert chosen.tolist() == eager.argmax(-1).tolist()
