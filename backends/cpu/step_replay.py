"""Steps replayed as a fixed list of compiled-kernel calls: the CPU's counterpart of CUDA
graphs (Platform.capture_graphs; --enforce-eager turns it off), with the same
`fits(seqs)` / `run(seqs, keep=None)` as backends/gpu/graphs.py.

A decode step of a small model is mostly per-op Python: the demo model's forward pass for one
request ran ~40 compiled kernels in ~1.8 ms, and the modules, shape checks, views and
temporaries around them took as long again. Here the eager pass is recorded
once (forward_recorder.py: its norms, linear layers, rotations, K/V writes, attention and
activations, in the order the model runs them), the step's buffers are allocated once (rows
for the largest batch), and each recorded step is bound to its kernel, its pointers and sizes,
reading where the step before it wrote (`_bind`); a step fills the inputs (token ids,
positions, slots, block tables, context lengths), looks up the embedding and the rotary rows
with two torch calls (where the embedding is float32, the step program gathers them), and runs
the list with the step's row count and thread count: each run of consecutive compiled kernels
in one call into csrc/step_program.cpp (OpSegment), the ops laid out once as words. The calls
are the eager path's own kernels on the same data in the same order (the query and key
rotations are two calls instead of one over both, the same arithmetic per head), so logits are
bit-identical to the eager step's. There is no second model here: the layers' order comes from
the eager pass, and a pass with a step this module does not bind, or with arithmetic outside
its steps, is not replayed.

A row is a token: steps with several tokens a request (prefills, chunks after a cached prefix,
speculative decoding's verification) replay too, every row at its own position with its
request's table, the buffers grown on first need (up to MAX_REPLAY_ROWS rows, within
REPLAY_BUFFER_BYTES); the last layer past its attention runs on the rows the eager step keeps.
In the eager bfloat16 step torch's float32/bfloat16 copies around the GEMMs took more time than
the GEMMs (docs/bench): a 2,040-token prefill step replayed takes 16 instead of 35 ms.

Captured only where the eager pass is all compiled kernels: float32 or 16-bit weights on the
panel kernel (or on oneDNN's packed GEMM, called through torch), weight-only quantized layers
of a float32 model (their GEMV; past its rows, their own forward), fused norms and activation,
LoRA adapters' products (backends/lora.py: each row's slot, added into the step's float32
buffers after each adapted layer), one rank; else None (eager steps).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.core.utils import cdiv

from ..models.decoder import CausalLM
from ..models.parallel import VocabParallelEmbedding
from . import native
from .forward_recorder import RECORDED_LINEARS, record_forward
from .model_kernels import Bfloat16Linear, FusedRMSNorm, PanelLinear
from .packed_linear import PackedLinear, bfloat16_dot_products, packed_linear, padded_rows
from .quantized_linear import CpuQuantizedLinear


def _ptr(t: torch.Tensor, offset_elements: int = 0) -> int:
    return t.data_ptr() + offset_elements * t.element_size()


logger = logging.getLogger("pagedllm.backends")


# A prefill step replays as a row per token: buffers for up to MAX_REPLAY_ROWS rows (the default
# token budget is 2,048) where they take at most REPLAY_BUFFER_BYTES, else max_batch rows.
MAX_REPLAY_ROWS, REPLAY_BUFFER_BYTES = 4096, 64 << 20


def replayable(model: CausalLM, kv_caches: torch.Tensor) -> bool:
    """Whether this model and cache can be replayed at all: the compiled kernels, one rank, a
    16/32-bit cache as one tensor. Which steps the pass has is the recording's business
    (capture_step_replay), and each binder checks the module it binds."""
    if not isinstance(kv_caches, torch.Tensor):  # an 8-bit cache's per-layer views: eager steps
        return False
    if native.unavailable_reason() is not None or model.tp.size != 1 or not kv_caches.is_contiguous():
        return False
    return kv_caches.dtype in native.ATTENTION_SUFFIX and type(model) is CausalLM


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NotReplayable(what)


class StepReplay:
    """`fits(seqs)` / `run(seqs, keep=None)` as the runner asks of every replay (Platform.capture_graphs)."""

    def __init__(
        self, model: CausalLM, kv_caches: torch.Tensor, block_size: int, max_batch: int, max_model_len: int, steps
    ):
        self.model, self.kv_caches, self.block_size, self.max_batch = model, kv_caches, block_size, max_batch
        self.max_blocks = cdiv(max_model_len, block_size)
        # prefill steps replay too, their buffers grown on first need up to REPLAY_BUFFER_BYTES
        self.row_cap = max(max_batch, min(MAX_REPLAY_ROWS, REPLAY_BUFFER_BYTES // self._bytes_per_row()))
        self.steps = steps  # the eager pass's, recorded (forward_recorder.py)
        # adapters add into each product: in the step's float32 buffers, from float32 inputs
        lora = any(s.kind == "lora" for s in steps)
        self.products_in_place = None if lora else self._onednn_throughout(steps, kv_caches.dtype)
        self._build(max_batch)

    def _bytes_per_row(self) -> int:
        """About what the step's buffers take a row (row_cap: REPLAY_BUFFER_BYTES / this)."""
        cfg, layer = self.model.config, self.model.layers[0]
        heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, cfg.head_dim
        width, inter = (heads + 2 * kv_heads) * d, layer.down_proj.in_features
        floats = 2 * d + 4 * cfg.hidden_size + width + 2 * heads * d + kv_heads * d + 3 * inter
        halves = 2 * kv_heads * d + cfg.hidden_size + inter + heads * d
        return 4 * floats + 2 * halves + 4 * self.max_blocks + 32

    def _build(self, capacity: int) -> None:
        """Buffers for steps of up to `capacity` tokens, and the calls bound to them."""
        model, kv_caches = self.model, self.kv_caches
        cfg, layer = model.config, model.layers[0]
        self.capacity = capacity
        heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, layer.down_proj.in_features
        # rows for the largest step, and the padding oneDNN's GEMMs run with (packed_linear.py);
        # zeros, so padding rows never hold what is not a number
        n, f32 = padded_rows(capacity), torch.float32
        self.ids = torch.zeros(n, dtype=torch.int64)
        self.positions = torch.zeros(n, dtype=torch.int64)
        self.slots = torch.zeros(n, dtype=torch.int64)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32)
        self.context = torch.ones(n, dtype=torch.int32)
        self.rows = torch.arange(n, dtype=torch.int32)  # row r attends with table row rows[r]
        self.lora_rows = torch.full((n,), -1, dtype=torch.int32)  # each row's adapter slot (-1: none)
        self.cos, self.sin = torch.zeros(n, d, dtype=f32), torch.zeros(n, d, dtype=f32)
        self.residual, self.normed = torch.zeros(n, hidden, dtype=f32), torch.zeros(n, hidden, dtype=f32)
        self.q, self.attn = torch.zeros(n, heads, d, dtype=f32), torch.zeros(n, heads, d, dtype=f32)
        self.k, self.act = torch.zeros(n, kv_heads, d, dtype=f32), torch.zeros(n, inter, dtype=f32)
        self.hidden_out = torch.zeros(n, hidden, dtype=f32)
        cache_dtype = kv_caches.dtype
        # 16-bit blocks: the rotated keys rounded to the cache's dtype first, as the eager write_kv rounds them
        self.k_half = torch.empty(n, kv_heads, d, dtype=cache_dtype) if cache_dtype != f32 else None
        self.num_slots = kv_caches.shape[2] * self.block_size
        lib = native._library()
        dot_products = int(bfloat16_dot_products())  # as the eager decode passes it
        row_bytes = kv_heads * d * kv_caches.element_size()
        if self.products_in_place is not None:
            calls = self._onednn_calls(model, lib, dot_products, row_bytes, self.products_in_place)
        else:
            calls = self._float32_buffer_calls(model, dot_products, row_bytes)
        # (up to the last layer's attention, the rest: see run())
        self.head, self.tail = calls
        self.greedy = self._greedy_program()

    def _float32_buffer_calls(self, model: CausalLM, dot_products: int, row_bytes: int) -> tuple:
        """The step's calls where some GEMM is the panel kernel's: every layer's input and output
        in the step's float32 buffers (oneDNN's bfloat16 layers round into and widen out of them)."""
        cfg, layer0, kv_caches = model.config, model.layers[0], self.kv_caches
        heads, kv_heads, d = layer0.num_heads, layer0.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * d, kv_heads * d
        width, hidden, inter = q_size + 2 * kv_size, cfg.hidden_size, layer0.down_proj.in_features
        n, f32 = self.ids.shape[0], torch.float32
        self.out, self.qkv = torch.zeros(n, hidden, dtype=f32), torch.zeros(n, width, dtype=f32)
        self.gate_up = torch.zeros(n, 2 * inter, dtype=f32)
        # 16-bit blocks: the values rounded to the cache's dtype first, as the eager write_kv rounds them
        self.v_half = torch.empty(n, kv_heads, d, dtype=kv_caches.dtype) if kv_caches.dtype != f32 else None
        self.v_view = self.qkv[:, q_size + kv_size :].view(n, kv_heads, d)
        rp = _ptr(self.residual)
        # a linear layer writes where the step after it reads
        linear_out = {"rotate": self.qkv, "norm": self.out, "act": self.gate_up}
        bfloat16_inputs: dict[int, torch.Tensor] = {}  # in_features -> the rounded rows, shared by the layers
        linear_input = [None]  # the last linear layer's, which its adapters read too

        def linear(step, x: torch.Tensor, after: str | None):
            module, out = step.module, linear_out.get(after)
            linear_input[0] = x
            _check(out is not None, f"a linear layer followed by {after}")
            _check(isinstance(module, RECORDED_LINEARS), f"a {type(module).__name__} layer")
            if isinstance(module, Bfloat16Linear):
                k_in = module.in_features
                if k_in not in bfloat16_inputs:
                    bfloat16_inputs[k_in] = torch.zeros(n, k_in, dtype=torch.bfloat16)
                return [OneDnnCall(module, x, bfloat16_inputs[k_in], out)], out
            if isinstance(module, PackedLinear):
                return [OneDnnCall(module, x, None, out)], out
            if isinstance(module, CpuQuantizedLinear):
                return [self._quantized_call(module, x, out)], out
            kind, w = native.PANEL_KINDS[module.packed.dtype], _ptr(module.packed)
            bias = 0 if module.bias is None else _ptr(module.bias)
            args = [kind, _ptr(x), w, module.out_features, module.in_features, bias, _ptr(out)]
            return [KernelOp("panel_linear", args)], out

        def norm(step, x: torch.Tensor, after: str | None):
            _check_norm(step, x, self.residual)
            out = self.hidden_out if after is None else self.normed
            wp, eps, op = _ptr(step.module.weight), _real(step.module.eps), _ptr(out)
            if not step.residual:  # the first layer's: the embedding is the residual stream
                return [KernelOp("rms_norm", [rp, wp, eps, op, hidden])], out
            return [KernelOp("add_rms_norm", [_ptr(x), rp, wp, eps, op, hidden])], out

        gp, ap = _ptr(self.gate_up), _ptr(self.act)

        def rotate(step, x, after):
            _check(step.layer.rotate is native.rotate and x is self.qkv, "a rotation but the fused one of qkv")
            return self._rotations(width, heads, kv_heads, d, q_size), x

        def act(step, x, after):
            _check(step.layer.act is native.silu_and_mul and x is self.gate_up, "an activation but the fused SiLU")
            return [KernelOp("silu_and_mul", [gp, ap, inter])], self.act

        return self._bind(
            {
                "norm": norm,
                "linear": linear,
                "lora": lambda step, out, after: (self._lora_calls(step.module, linear_input[0], out), out),
                "rotate": rotate,
                "write_kv": lambda step, x, after: ([self._write_kv(step.index, row_bytes)], x),
                "attend": lambda step, x, after: ([self._attend_step(step, dot_products)], self.attn),
                "act": act,
            }
        )

    def _lora_calls(self, projection, x: torch.Tensor, out: torch.Tensor) -> list[KernelOp]:
        """Each adapted module's product added into its columns of the linear layer's output, as
        LoRAProjection.forward adds it: the compiled kernel up to LORA_ROWS_PER_ROW_KERNEL rows,
        the backend's add_lora (torch's GEMMs) past them, as the eager step chooses."""
        from .ops import LORA_ROWS_PER_ROW_KERNEL

        slots, x = projection.slots, x.view(x.shape[0], -1)
        _check(out.dim() == 2 and out.stride(1) == 1 and x.stride(1) == 1, "adapters on strided rows")
        scales, rows_slot = slots.scales, self.lora_rows
        calls = []
        for module, start, end in projection.parts:
            # as they are (converting them would leave the eager step's copies unbound)
            a, b = slots.weights(projection.layer, module)
            transposed = native.lora_b_transposed(b)
            _check(a.is_contiguous() and (transposed or b.is_contiguous()), "adapters' weights in another layout")
            _check(a.dtype == scales.dtype == torch.float32, "adapters' weights in another dtype")
            args = [_ptr(out, start), out.stride(0), _ptr(x), x.stride(0), x.shape[1], end - start]
            args += [_ptr(a), _ptr(b), a.shape[1], _ptr(rows_slot), _ptr(scales), int(transposed)]

            def fallback(rows, threads, a=a, b=b, start=start, end=end):
                slots.ops.add_lora(out[:rows, start:end], x[:rows], a, b, rows_slot[:rows], scales)

            calls.append(KernelOp("add_lora", args, max_rows=LORA_ROWS_PER_ROW_KERNEL, fallback=fallback))
        return calls

    def _quantized_call(self, module: CpuQuantizedLinear, x: torch.Tensor, out: torch.Tensor) -> KernelOp:
        """A weight-only quantized layer of a float32 model, as its forward runs it: the GEMV up
        to its gemv_max_rows rows (same kernel, same rows: the same bits), its own forward past
        them (oneDNN's GEMM on the decoded weights)."""
        _check(self.model.config.dtype == torch.float32, "quantized layers in a 16-bit model")
        _check(module.perm is None, "a quantized layer in act order")
        kind, codes, row_bytes, scales, zeros, lut = native.quantized_args(
            module.kind, module.codes, module.scales, module.zeros, module.lut
        )
        bias = 0 if module.bias is None else _ptr(module.bias)
        args = [kind, _ptr(x), codes, row_bytes, scales, zeros or 0, lut or 0, bias]
        args += [module.out_features, module.in_features, module.group, _ptr(out)]

        def forward(rows, threads):
            out[:rows] = module(x[:rows].reshape(rows, module.in_features))

        return KernelOp("quantized_gemv", args, max_rows=module.gemv_max_rows, fallback=forward)

    def _bind(self, binders: dict) -> list:
        """The recorded steps' calls, each bound by its kind's binder, `(step, what the step before
        wrote, the next step's kind) -> (calls, what this one writes)`: a step reads what the
        one before it wrote and writes where the one after it reads."""
        calls, value = [], self.residual  # the embedding, looked up in run()
        # what comes after each step, an adapter's product (which adds into the linear layer's) aside
        following, after = [], None
        for step in reversed(self.steps):
            following.append(after)
            after = after if step.kind == "lora" else step.kind
        prune_at = 0
        for step, after in zip(self.steps, reversed(following)):
            new, value = binders[step.kind](step, value, after)
            calls += new
            if step.kind == "attend":
                prune_at = len(calls)  # after the last layer's attention: see run()
        if value is not self.hidden_out:
            raise NotReplayable("the pass does not end with the final norm")
        inputs = self._input_ops()
        self.inputs_gathered = bool(inputs)
        lib = native._library()
        return segments(lib, inputs + calls[:prune_at]), segments(lib, calls[prune_at:])

    def _attend_step(self, step, dot_products: int) -> KernelOp:
        """The layer's attention over the cache (shape: heads, KV heads, head size, block size),
        with its scale and window (0: none), no soft cap."""
        layer, cache = step.layer, self.kv_caches[step.index]
        suffix = native.ATTENTION_SUFFIX[self.kv_caches.dtype]
        args = [_ptr(self.q), _ptr(cache[0]), _ptr(cache[1]), _ptr(self.tables), self.max_blocks, _ptr(self.rows)]
        args += [_ptr(self.context), layer.num_heads, layer.num_kv_heads, self.model.config.head_dim, self.block_size]
        args += [_real(layer.scale), layer.window or 0, _real(0.0), _ptr(self.attn), dot_products]
        return KernelOp(f"attention_{suffix}", args)

    @staticmethod
    def _onednn_throughout(steps, cache_dtype: torch.dtype) -> torch.dtype | None:
        """bfloat16 where every recorded linear layer is on oneDNN's bfloat16 GEMM over a bfloat16
        cache, float32 where every one is on its float32 GEMM over a float32 cache: the steps that
        read each GEMM's product where it lies (_onednn_calls); else None."""
        linears = [s.module for s in steps if s.kind == "linear"]
        if cache_dtype == torch.bfloat16 and all(isinstance(m, Bfloat16Linear) for m in linears):
            return torch.bfloat16
        if cache_dtype == torch.float32 and all(type(m) is PackedLinear for m in linears):
            return torch.float32
        return None

    def _onednn_calls(self, model: CausalLM, lib, dot_products: int, row_bytes: int, dtype) -> tuple:
        """The step's calls where every GEMM is oneDNN's, of `dtype`: the kernels after a GEMM
        read its product where oneDNN left it (rotations, K/V writes, norms, the activation)
        instead of a copy in the step's float32 buffers; in bfloat16 the norms and the
        activation also write their rows rounded for the next GEMM, where the float32 buffers'
        path rounds and widens each layer's inputs and outputs in eight copies (9% of a step,
        docs/bench). The same roundings at the same places: the same bits as the eager step."""
        cfg, layer0 = model.config, model.layers[0]
        heads, kv_heads, d = layer0.num_heads, layer0.num_kv_heads, cfg.head_dim
        q_size, hidden, inter = heads * d, cfg.hidden_size, layer0.down_proj.in_features
        n = self.ids.shape[0]
        if dtype == torch.bfloat16:
            normed, act = torch.zeros(n, hidden, dtype=dtype), torch.zeros(n, inter, dtype=dtype)
            attn_rounded = torch.zeros(n, q_size, dtype=dtype)  # attention's float32 rows, rounded for o_proj
            x16, out16 = native.MIXED_X_BF16, native.MIXED_OUT_BF16
        else:
            normed, act, attn_rounded, x16, out16 = self.normed, self.act, None, 0, 0
        rp, np_, ap, hp = _ptr(self.residual), _ptr(normed), _ptr(act), _ptr(self.hidden_out)

        def norm(step, product, after):
            _check_norm(step, product, self.residual)
            wp, eps = _ptr(step.module.weight), step.module.eps
            out, formats = (hp, x16) if after is None else (np_, x16 | out16)
            if not step.residual:  # the first layer's: the embedding is the residual stream

                def first(rows, threads):
                    lib.pagedllm_rms_norm_mixed(rp, wp, eps, np_, rows, hidden, out16, threads)

                return [first], normed
            _check(isinstance(product, OneDnnCall), "a norm that does not follow a linear layer")

            def call(rows, threads):
                x = product.take()
                lib.pagedllm_add_rms_norm_mixed(x.data_ptr(), rp, wp, eps, out, rows, hidden, formats, threads)

            return [call], (self.hidden_out if after is None else normed)

        def linear(step, x, after):
            _check(isinstance(x, torch.Tensor), "a linear layer that reads another's product")
            _check(isinstance(step.module, (Bfloat16Linear, PackedLinear)), f"a {type(step.module).__name__} layer")
            product = OneDnnCall(step.module, x, attn_rounded if x is self.attn else None, None)
            return [product], product

        pending = []  # the qkv product whose rotation is done with its K/V write

        def rotate(step, qkv, after):
            _check(isinstance(qkv, OneDnnCall) and after == "write_kv", "a rotation but of qkv, before its K/V write")
            _check(step.layer.rotate is native.rotate, "a rotation but the fused one")
            pending.append(qkv)
            return [], qkv

        def write_kv(step, value, after):
            cache = self.kv_caches[step.index]
            return [self._rotate_and_write(lib, pending.pop(), cache, (heads, kv_heads, d), row_bytes, dtype)], value

        def activation(step, gate_up, after):
            _check(isinstance(gate_up, OneDnnCall), "an activation that does not follow a linear layer")
            _check(step.layer.act is native.silu_and_mul, "an activation but the fused SiLU")

            def call(rows, threads):
                x = gate_up.take()
                lib.pagedllm_silu_and_mul_mixed(x.data_ptr(), ap, rows, inter, x16 | out16, threads)

            return [call], act

        return self._bind(
            {
                "norm": norm,
                "linear": linear,
                "rotate": rotate,
                "write_kv": write_kv,
                "attend": lambda step, x, after: ([self._attend_step(step, dot_products)], self.attn),
                "act": activation,
            }
        )

    def _rotate_and_write(self, lib, qkv: OneDnnCall, cache: torch.Tensor, dims: tuple, row_bytes: int, dtype):
        """The rotations read straight from the qkv GEMM's product (of `dtype`), the keys
        rounded to the cache's dtype as they are written; the values go to the cache from the
        product as they are."""
        heads, kv_heads, d = dims
        q_size, kv_size, size = heads * d, kv_heads * d, dtype.itemsize
        width = q_size + 2 * kv_size
        keys = self.k_half if dtype == torch.bfloat16 else self.k
        cos, sin, q, kp = _ptr(self.cos), _ptr(self.sin), _ptr(self.q), _ptr(keys)
        kc, vc, slots, num_slots = _ptr(cache[0]), _ptr(cache[1]), _ptr(self.slots), self.num_slots
        x16 = native.MIXED_X_BF16 if dtype == torch.bfloat16 else 0
        both = x16 | (native.MIXED_OUT_BF16 if dtype == torch.bfloat16 else 0)

        def rotate_and_write(rows, threads):
            product = qkv.take()  # alive until the K/V are written
            x = product.data_ptr()
            k, v, v_stride = x + q_size * size, x + (q_size + kv_size) * size, width * size
            lib.pagedllm_rotary_mixed(x, width, cos, sin, q, rows, heads, d, x16, threads)
            lib.pagedllm_rotary_mixed(k, width, cos, sin, kp, rows, kv_heads, d, both, threads)
            if lib.pagedllm_write_kv(kp, row_bytes, v, v_stride, slots, rows, row_bytes, kc, vc, num_slots, threads):
                raise IndexError(f"write_kv: a slot outside the cache's {num_slots} slots")

        return rotate_and_write

    def _rotations(self, width, heads, kv_heads, d, q_size) -> list:
        cos, sin = _ptr(self.cos), _ptr(self.sin)
        return [
            KernelOp("rotary", [_ptr(self.qkv), width, cos, sin, _ptr(self.q), heads, d]),
            KernelOp("rotary", [_ptr(self.qkv, q_size), width, cos, sin, _ptr(self.k), kv_heads, d]),
        ]

    def _input_ops(self) -> list:
        """The step's embedding rows and rotary rows, gathered by the step's program where the
        embedding is float32 (else run() looks them up with torch)."""
        model = self.model
        embedding = model.embed_tokens
        if type(embedding) is not VocabParallelEmbedding or embedding.tp.size != 1:
            return []
        table = embedding.weight
        if table.dtype != torch.float32 or not table.is_contiguous():
            return []
        cos, sin = model.rope.cos, model.rope.sin
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()):
            return []

        def gather(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor, what: str = "") -> KernelOp:
            return KernelOp("gather_rows", [_ptr(rows), _ptr(index), rows.shape[1] * 4, rows.shape[0], _ptr(out)], what)

        out_of = f"a token id outside the embedding's {table.shape[0]} rows"
        positions = self.positions
        return [
            gather(table, self.ids, self.residual, out_of),
            gather(cos, positions, self.cos),
            gather(sin, positions, self.sin),
        ]

    def _write_kv(self, layer: int, row_bytes: int):
        cache = self.kv_caches[layer]
        kc, vc, slots = _ptr(cache[0]), _ptr(cache[1]), _ptr(self.slots)
        num_slots = self.num_slots
        what = f"write_kv: a slot outside the cache's {num_slots} slots"
        if self.k_half is None:
            k_stride, v_stride = self.k.stride(0) * 4, self.v_view.stride(0) * 4
            args = [_ptr(self.k), k_stride, _ptr(self.v_view), v_stride, slots, row_bytes, kc, vc, num_slots]
            return KernelOp("write_kv", args, what=what)
        k_half, v_half = self.k_half, self.v_half
        stride = k_half.stride(0) * k_half.element_size()
        args = [_ptr(k_half), stride, _ptr(v_half), stride, slots, row_bytes, kc, vc, num_slots]
        write = KernelOp("write_kv", args, what=what)
        lib = native._library()

        def write_rounded(rows, threads):
            k_half[:rows].copy_(self.k[:rows])
            v_half[:rows].copy_(self.v_view[:rows])
            run_ops(lib, [write], rows, threads)

        return write_rounded

    def _greedy_program(self) -> GreedyProgram | None:
        """The step as greedy_step runs it, where a decode step can run whole in compiled code:
        every call a compiled kernel, the inputs gathered, the LM head on the panel kernel with
        no soft cap; else None."""
        model = self.model
        calls = [*self.head, *self.tail]
        if not self.inputs_gathered or not all(isinstance(c, OpSegment) for c in calls):
            return None
        head = model.lm_head
        if type(head) is not PanelLinear or model.config.final_soft_cap:
            return None
        n = self.ids.shape[0]
        logits = torch.zeros(n, head.out_features, dtype=torch.float32)
        bias = 0 if head.bias is None else _ptr(head.bias)
        args = [native.PANEL_KINDS[head.packed.dtype], _ptr(self.hidden_out), _ptr(head.packed)]
        lm_head = KernelOp("panel_linear", [*args, head.out_features, head.in_features, bias, _ptr(logits)])
        self.num_blocks = torch.zeros(n, dtype=torch.int32)
        self.tokens = torch.zeros(n, dtype=torch.int64)
        ops = [op for segment in calls for op in segment.ops]
        max_rows = min((op.max_rows for op in ops if op.max_rows is not None), default=n)
        words = np.concatenate([c.words for c in calls])
        return GreedyProgram(words, _words([lm_head]), logits, min(max_rows, n), ops)

    def greedy_fits(self, rows: int) -> bool:
        return self.greedy is not None and rows <= self.greedy.max_rows

    def greedy_step(self, seqs, threads: int) -> np.ndarray:
        """A decode step whose rows all choose greedily, run whole in one compiled call: the
        replayed step, the LM head and argmax (as ModelRunner.execute and the sampler's greedy
        rows compute them: the same bits). `seqs`: the step's decodes; None: the same rows as
        the step before, each on the token it chose (positions, slots and context one further).
        Returns the chosen token ids (a view of a buffer the next step overwrites)."""
        words, lm_head, logits, _, ops = self.greedy
        if seqs is not None:
            self._fill_inputs(seqs)
            self.greedy_rows = len(seqs)
            # numpy's view: the buffers may be inference tensors, and this runs outside inference mode
            self.num_blocks.numpy()[: len(seqs)] = [min(len(s.block_ids), self.max_blocks) for s in seqs]
        rows = self.greedy_rows
        failed = native._library().pagedllm_greedy_step(
            words.ctypes.data,
            len(ops),
            lm_head.ctypes.data,
            _ptr(logits),
            logits.shape[1],
            self.model.config.vocab_size,
            rows,
            threads,
            seqs is None,
            *map(_ptr, (self.ids, self.positions, self.context, self.slots, self.tables, self.rows, self.num_blocks)),
            self.max_blocks,
            self.block_size,
            _ptr(self.tokens),
        )
        if failed == len(ops) + 1:
            raise IndexError("greedy_step: a row's next position has no block in its table")
        if failed >= 0:
            raise refusal(ops[failed] if failed < len(ops) else KernelOp("panel_linear (the LM head)", []))
        return self.tokens.numpy()[:rows]

    def fits(self, seqs) -> bool:
        """Decode steps, chunks after a cached context (speculative decoding's verification) and
        prefill steps: a row per token, up to row_cap of them."""
        if not seqs or sum(len(s.token_ids) for s in seqs) > self.row_cap:
            return False
        limit = self.max_blocks * self.block_size
        return all(s.start_pos + len(s.token_ids) <= limit for s in seqs)

    def run(self, seqs, keep: np.ndarray | None = None) -> torch.Tensor:
        """The final hidden states of the step's tokens, [rows, hidden] float32: of every token in
        the order of `seqs`, or of the rows `keep` indexes, in that order (the eager step's
        keep_rows: the last layer computes past its attention for those rows only). Row r
        attends with its request's table up to its own position."""
        rows = sum(len(s.token_ids) for s in seqs)
        # a step may keep more rows than it computes (a verification's or a prompt-logprobs
        # chunk's last row is kept twice: as its sequence's last and as a wanted row), at most
        # twice as many: those buffers grow past row_cap if need be
        need = rows if keep is None else max(rows, len(keep))
        if need > self.capacity:
            self._build(max(need, min(self.row_cap, 2 * self.capacity)))
        self._fill_inputs(seqs)
        if not self.inputs_gathered:
            model = self.model
            self.residual[:rows].copy_(model.embed_tokens(self.ids[:rows]))
            torch.index_select(model.rope.cos, 0, self.positions[:rows], out=self.cos[:rows])
            torch.index_select(model.rope.sin, 0, self.positions[:rows], out=self.sin[:rows])
        threads = torch.get_num_threads()
        for call in self.head:
            call(rows, threads)
        if keep is not None:
            index = torch.from_numpy(np.asarray(keep, dtype=np.int64))
            self.attn[: len(keep)] = self.attn[index]
            self.residual[: len(keep)] = self.residual[index]
            self.lora_rows[: len(keep)] = self.lora_rows[index]
            rows = len(keep)
        for call in self.tail:
            call(rows, threads)
        return self.hidden_out[:rows]

    def _fill_inputs(self, seqs) -> None:
        """Token ids, positions, slots, block tables and context lengths of the step's rows."""
        bs = self.block_size
        ids, positions, slots = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        tables, context, table_of = self.tables.numpy(), self.context.numpy(), self.rows.numpy()
        adapters = self.lora_rows.numpy()
        r = 0
        for j, s in enumerate(seqs):
            blocks = s.block_ids[: self.max_blocks]
            tables[j, : len(blocks)] = blocks
            n = len(s.token_ids)
            if n == 1:  # a decode row: numpy's per-call cost is more than the row's
                pos = s.start_pos
                ids[r], positions[r], context[r], table_of[r] = s.token_ids[0], pos, pos + 1, j
                slots[r], adapters[r] = blocks[pos // bs] * bs + pos % bs, s.lora_slot
            else:
                pos = np.arange(s.start_pos, s.start_pos + n)
                ids[r : r + n], positions[r : r + n], context[r : r + n] = s.token_ids, pos, pos + 1
                table_of[r : r + n], adapters[r : r + n] = j, s.lora_slot
                slots[r : r + n] = tables[j, pos // bs] * bs + pos % bs
            r += n


# csrc/step_program.cpp's kinds of op, and the int64 words an op takes (its kind, its arguments)
OP_KINDS = {
    name: i
    for i, name in enumerate(
        (
            "gather_rows",
            "panel_linear",
            "rms_norm",
            "add_rms_norm",
            "rotary",
            "write_kv",
            "attention_f32",
            "attention_bf16",
            "attention_f16",
            "silu_and_mul",
            "quantized_gemv",
            "add_lora",
        ),
        start=1,
    )
}
OP_WORDS = 20


def _real(x: float) -> int:
    """A float argument as the step program takes it: the bits of a double."""
    return int(np.float64(x).view(np.int64))


class GreedyProgram(NamedTuple):
    """A replayed decode step as greedy_step runs it (csrc/step_program.cpp's words)."""

    words: np.ndarray  # the step's ops, head and tail
    lm_head: np.ndarray  # the LM head's op, into `logits`
    logits: torch.Tensor  # [rows, the LM head's outputs]
    max_rows: int  # the most rows every op takes
    ops: list  # the KernelOps behind `words`, for their errors


class KernelOp:
    """One compiled kernel's call in a replayed step: its kind and arguments as
    csrc/step_program.cpp takes them (the step's rows and threads added there); `what` the
    error when the kernel refuses its input; past `max_rows` rows `fallback(rows, threads)`
    runs instead (a quantized layer's own forward)."""

    __slots__ = ("args", "fallback", "kind", "max_rows", "what")

    def __init__(self, kind: str, args: list[int], what: str = "", max_rows: int | None = None, fallback=None):
        self.kind, self.args, self.what, self.max_rows, self.fallback = kind, args, what, max_rows, fallback


def _words(ops: list[KernelOp]) -> np.ndarray:
    words = np.zeros((len(ops), OP_WORDS), dtype=np.int64)
    for i, op in enumerate(ops):
        words[i, 0] = OP_KINDS[op.kind]
        words[i, 1 : 1 + len(op.args)] = op.args
    return words


def run_ops(lib, ops: list[KernelOp], rows: int, threads: int, words: np.ndarray | None = None) -> None:
    """The ops in order, in one call; IndexError with the refusing op's `what`."""
    words = _words(ops) if words is None else words
    failed = lib.pagedllm_run_ops(words.ctypes.data, len(ops), rows, threads)
    if failed >= 0:
        raise refusal(ops[failed])


def refusal(op: KernelOp) -> IndexError:
    """The error of an op that refused its input: its `what`, else its kind."""
    return IndexError(op.what or f"{op.kind}: an index outside its table")


class OpSegment:
    """Consecutive KernelOps of a step, run by one call into the step program (no ctypes call
    and Python frame per kernel); one at a time where the step has more rows than one allows."""

    def __init__(self, lib, ops: list[KernelOp]):
        self.lib, self.ops, self.words = lib, ops, _words(ops)
        self.max_rows = min((op.max_rows for op in ops if op.max_rows is not None), default=None)

    def __call__(self, rows: int, threads: int) -> None:
        if self.max_rows is None or rows <= self.max_rows:
            run_ops(self.lib, self.ops, rows, threads, self.words)
            return
        for i, op in enumerate(self.ops):
            if op.max_rows is not None and rows > op.max_rows:
                op.fallback(rows, threads)
            else:
                run_ops(self.lib, [op], rows, threads, self.words[i : i + 1])


def segments(lib, calls: list) -> list:
    """The calls with each run of consecutive KernelOps made one OpSegment."""
    out, run = [], []
    for call in [*calls, None]:
        if isinstance(call, KernelOp):
            run.append(call)
            continue
        if run:
            out.append(OpSegment(lib, run))
            run = []
        if call is not None:
            out.append(call)
    return out


class OneDnnCall:
    """A PackedLinear (float32) or Bfloat16Linear in a replayed step: for bfloat16 float32 rows
    are rounded into a preallocated buffer (`rounded`) first (bfloat16 rows go as they are);
    oneDNN's product is copied into the step's float32 buffer `out`, or, with no `out`, kept
    as `result` for the next kernel to read; at padded_rows' count as the eager layer runs
    them; the views of each row count made once (a replayed step is ~17 such calls, where
    torch's per-op cost is what a row costs)."""

    def __init__(self, module: PackedLinear, x: torch.Tensor, rounded: torch.Tensor | None, out: torch.Tensor | None):
        self.packed, self.bias = module.packed, module.bias
        self.x, self.rounded = x.view(x.shape[0], -1), rounded
        self.out = None if out is None else out.view(out.shape[0], -1)
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self.result: torch.Tensor | None = None

    def __call__(self, rows: int, threads: int) -> None:
        views = self.views.get(rows)
        if views is None:
            padded = padded_rows(rows)
            rounded = None if self.rounded is None else self.rounded[:padded]
            out = None if self.out is None else self.out[:padded]
            views = self.views[rows] = (self.x[:padded], rounded, out)
        x, rounded, out = views
        if rounded is not None:
            rounded.copy_(x)
            x = rounded
        product = packed_linear(x, self.packed, self.bias)
        if out is None:
            self.result = product
        else:
            out.copy_(product)

    def take(self) -> torch.Tensor:
        """The product, for its one reader, which holds it while it reads: a step then keeps one
        or two products alive, not every layer's (an engine's steps come one at a time)."""
        product, self.result = self.result, None
        return product


class NotReplayable(Exception):
    """The recorded pass has a step, or an order of steps, the replay does not bind."""


def _check_norm(step, x, embedding) -> None:
    """A fused norm that adds the residual stream, or the first one, over the embedding."""
    _check(isinstance(step.module, FusedRMSNorm), f"a {type(step.module).__name__} norm")
    _check(step.residual or x is embedding, "a norm without the residual stream but the first layer's")


def capture_step_replay(model, kv_caches, block_size: int, max_batch: int, max_model_len: int):
    """A StepReplay of the model's eager pass (recorded), or None where a step of it is not one
    of the compiled kernels the replay binds (or the pass computes outside them)."""
    if not replayable(model, kv_caches):
        return None
    steps = record_forward(model, kv_caches)
    if steps is None or any(set(s.options) - {"window"} for s in steps):  # soft caps, KV scales: eager
        return None
    try:
        return StepReplay(model, kv_caches, block_size, max_batch, max_model_len, steps)
    except NotReplayable as e:
        logger.info("steps run eagerly: %s", e)
        return None
