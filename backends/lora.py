"""Multi-LoRA on the worker (AdapterExecutor, the step executor executor_for picks under
enable_lora): a fixed set of adapter slots (max_loras) whose weights sit stacked
per projection, the projections wrapped to add each row's adapter product (AttentionOps.add_lora,
every row its own slot, -1 for the base model), and the adapters' weights loaded from their
PEFT folders into a slot when a step needs one that is not resident.

Slots: least recently used first, never one a request of the current step uses (the scheduler
admits at most max_loras adapters into a step, so one is always free). Adapters read from disk
are kept in host memory for the next time (max_cpu_loras, least recently used out)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from safetensors.torch import load_file
from torch import nn

from pagedllm.core.lora import LoRARequest, module_shapes, read_adapter
from pagedllm.core.model_folder import model_folder

from .models.loader import SPLITS, shard_range
from .runner import SeqInput
from .step_executor import StepExecutor

# each wrapped projection of a decoder layer: (its attribute, [(target module, output slice index)])
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRAProjection(nn.Module):
    """A projection and its adapters: base(x), then for each target module it fuses, the rows'
    adapter products added into that module's columns of the output."""

    def __init__(self, base: nn.Module, slots: LoRASlots, layer: int, parts: list[tuple[str, int, int]]):
        super().__init__()
        self.base, self.slots, self.layer, self.parts = base, slots, layer, parts

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = self.slots.rows_for(x.shape[0])
        if rows is None:
            return out
        for module, start, end in self.parts:
            a, b = self.slots.weights(self.layer, module, x.dtype)
            self.slots.ops.add_lora(out[:, start:end], x, a, b, rows, self.slots.scales)
        return out


class LoRASlots:
    def __init__(self, model, ops, model_dir: str, max_loras: int, max_rank: int, max_cpu_loras: int | None):
        self.ops, self.max_rank = ops, max_rank
        self.model_config = model_folder(model_dir).config
        self.max_cpu_loras = max_cpu_loras or max_loras
        shapes = module_shapes(self.model_config)
        # B kept as [S, r, out] where the backend's expand wants it (AttentionOps.lora_b_transposed)
        self.b_transposed = ops.lora_b_transposed
        # each module's slice on this rank (tensor parallelism): A split as a row-parallel base
        # weight (by input), B as a column-parallel one (by output); the partial products of a
        # row-parallel projection add up in its all-reduce as the base ones do
        self.splits: dict[str, tuple[int, slice]] = {}
        for module in shapes:
            dim, kind = SPLITS[("self_attn." if module in ATTENTION else "mlp.") + module]
            start, size = shard_range(kind, model.shards, model.config)
            self.splits[module] = (dim, slice(start, start + size))
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        device = next(model.parameters()).device
        for index, layer in enumerate(model.layers):
            for attr, modules in FUSED.items():
                base = getattr(layer, attr)
                if base is None:  # a mixture of experts' MLP: no adapters there
                    continue
                parts, start = [], 0
                for module in modules:
                    width_in, width_out = shapes[module]
                    dim, part = self.splits[module]
                    if dim == 0:
                        width_out = part.stop - part.start
                    else:
                        width_in = part.stop - part.start
                    parts.append((module, start, start + width_out))
                    start += width_out
                    self.a[index, module] = torch.zeros(max_loras, max_rank, width_in, device=device)
                    b_shape = (max_rank, width_out) if self.b_transposed else (width_out, max_rank)
                    self.b[index, module] = torch.zeros(max_loras, *b_shape, device=device)
                setattr(layer, attr, LoRAProjection(base, self, index, parts))
        self.scales = torch.zeros(max_loras, device=device)
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(max_loras))
        self.host: OrderedDict[int, tuple[float, dict]] = OrderedDict()  # adapter id -> (scale, tensors)
        self.full_rows: torch.Tensor | None = None
        self.kept_rows: torch.Tensor | None = None

    # --- a step's rows -----------------------------------------------------------------------
    def slot_of(self, lora: LoRARequest | None, busy: set[int]) -> int:
        """The slot holding `lora` (-1 for the base model), loaded now if it is not resident;
        `busy`: slots this step's other rows use, never given up."""
        if lora is None:
            return -1
        slot = self.resident.get(lora.lora_int_id)
        if slot is None:
            slot = self._take_slot(busy)
            self._load(lora, slot)
            self.resident[lora.lora_int_id] = slot
        self.resident.move_to_end(lora.lora_int_id)
        return slot

    def set_rows(self, rows: torch.Tensor | None, keep: torch.Tensor | None) -> None:
        """Each token row's slot for the next forward (None: no row has an adapter), and those
        of the rows the last layer keeps (CausalLM's keep_rows)."""
        self.full_rows = rows
        self.kept_rows = None if rows is None or keep is None else rows[keep]

    def rows_for(self, num_rows: int) -> torch.Tensor | None:
        if self.full_rows is None:
            return None
        return self.full_rows if num_rows == self.full_rows.shape[0] else self.kept_rows

    def weights(self, layer: int, module: str, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A [S, r, in] and B [S, out, r] (a view where kept transposed) as add_lora takes them,
        in `dtype` (None: as they are)."""
        a, b = self.a[layer, module], self.b[layer, module]
        if dtype is not None and a.dtype != dtype:  # the dtype the model computes in, settled by its first forward
            a = self.a[layer, module] = a.to(dtype)
            b = self.b[layer, module] = b.to(dtype)
        return a, (b.transpose(1, 2) if self.b_transposed else b)

    # --- loading ------------------------------------------------------------------------------
    def _take_slot(self, busy: set[int]) -> int:
        if self.free:
            return self.free.pop(0)
        for adapter, slot in self.resident.items():  # least recently used first
            if slot not in busy:
                del self.resident[adapter]
                return slot
        raise RuntimeError("every LoRA slot is in use by this step (the scheduler admits at most max_loras)")

    def _load(self, lora: LoRARequest, slot: int) -> None:
        scale, tensors = self._host_copy(lora)
        for key in self.a:
            a, b = tensors.get(key, (None, None))
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            if a is not None:
                dim, part = self.splits[key[1]]
                a, b = (a, b[part]) if dim == 0 else (a[:, part], b)
                self.a[key][slot, : a.shape[0]].copy_(a)
                if self.b_transposed:
                    self.b[key][slot, : b.shape[1]].copy_(b.T)
                else:
                    self.b[key][slot, :, : b.shape[1]].copy_(b)
        self.scales[slot] = scale

    def _host_copy(self, lora: LoRARequest) -> tuple[float, dict]:
        held = self.host.get(lora.lora_int_id)
        if held is None:
            spec = read_adapter(lora, self.model_config, self.max_rank)
            saved = load_file(f"{lora.lora_path}/adapter_model.safetensors")
            pairs: dict[tuple[int, str], list] = {}
            for key, (layer, module, side) in spec.tensors.items():
                pairs.setdefault((layer, module), [None, None])[0 if side == "A" else 1] = saved[key]
            held = (spec.scale, {k: tuple(v) for k, v in pairs.items()})
            self.host[lora.lora_int_id] = held
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora.lora_int_id)
        return held


class AdapterExecutor(StepExecutor):
    """The step with adapters: the projections wrapped once the backend has prepared the model
    (attach), each chunk run under its adapter's slot, and steps replayed only where the
    backend's replay adds the adapters' products (replays_lora): the step executor's hooks, so
    the worker knows nothing of LoRA."""

    def attach(self, runner, make_runner) -> None:
        super().attach(runner, make_runner)
        cfg = self.config
        runner.lora = LoRASlots(self.model, self.ops, cfg.model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras)

    def runners(self) -> tuple:
        # a backend whose replay reads each row's slot (the cpu backend's step replay); a GPU
        # graph would be captured without the adapters' products
        return (self.runner,) if getattr(self.ops, "replays_lora", False) else ()

    def seq_inputs(self, chunks) -> list[SeqInput]:
        """Each chunk with its adapter's slot (-1: the base model), loaded where it is not."""
        slots, busy = self.runner.lora, set()
        seqs = []
        for c in chunks:
            slot = slots.slot_of(c.state.lora, busy)
            busy.add(slot)
            seqs.append(SeqInput(c.token_ids, c.start, c.state.block_ids, slot))
        return seqs
