"""The cpu backend's replayed decode steps (backends/cpu/decode_replay.py) must compute what the
eager step computes, bit for bit — logits and the K/V written — in float32 and 16-bit, and be
left out where a step is not all compiled kernels."""

import pytest
import torch

from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.cpu.decode_replay import DecodeReplay
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.entrypoints.default_model import shipped_model_dir

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


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", None), ("float32", 21)])
def test_a_replayed_decode_step_equals_the_eager_one(dtype, window):
    runner, replay = runner_and_replay(dtype, window=window)
    assert isinstance(replay, DecodeReplay)
    prompts = [list(range(10, 10 + n)) for n in (1, 15, 16, 130)]  # contexts across block edges
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    runner.execute([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    before = runner.kv_caches.clone()
    for batch in ([0, 1, 2, 3], [3], [2, 0]):  # one set of buffers serves every batch size
        seqs = [SeqInput([5 + i], len(prompts[i]), tables[i]) for i in batch]
        runner.kv_caches.copy_(before)
        runner.decode_graphs = None
        eager = runner.execute(seqs)
        eager_kv = runner.kv_caches.clone()
        runner.kv_caches.copy_(before)
        runner.decode_graphs = replay
        assert replay.fits(seqs)
        assert torch.equal(runner.execute(seqs), eager)
        assert torch.equal(runner.kv_caches, eager_kv)


def test_what_a_replay_does_not_take():
    replay = runner_and_replay("float32", max_batch=2)[1]
    table = list(range(1, 11))
    assert not replay.fits([SeqInput([1, 2], 0, table)])  # a prefill chunk
    assert not replay.fits([SeqInput([1], 3, table)] * 3)  # more rows than captured
    assert not replay.fits([SeqInput([1], 512, table)])  # past the captured context
    _, quantized = runner_and_replay("float32", quantization="int8")
    assert quantized is None  # its linear layers are not on the panel kernel: eager steps


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
