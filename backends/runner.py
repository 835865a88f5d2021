"""Model runner: one step's requests in, the logits of each request's last scheduled token out
(and, for prompt logprobs, the hidden states of other tokens asked for)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.utils import cdiv
from pagedllm.core.worker_state import slot_mapping

from .attention import AttentionMetadata, AttentionOps, DecodeMetadata, PrefillMetadata
from .kv_cache import allocate_pool, layer_caches
from .models.quantized import use_kernels


@dataclass
class SeqInput:
    """One request's share of a step."""

    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # tokens already in the cache (num_computed_tokens)
    block_ids: list[int]  # the request's block table, covering start_pos + len(token_ids)
    lora_slot: int = -1  # its LoRA adapter's slot (backends/lora.py), -1: the base model


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # row of each request's last token, in the caller's order
    first_rows: np.ndarray  # row of each request's first token, in the caller's order
    lora_rows: torch.Tensor | None = None  # int32 adapter slot of each token row; None: no adapter


def prepare_batch(seqs: list[SeqInput], block_size: int, device="cpu") -> StepBatch:
    """Flatten requests into one batch: decodes (one new token) first, then prefills."""
    decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    prefills = [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
    order = decodes + prefills
    q_lens = np.array([len(seqs[i].token_ids) for i in order], dtype=np.int64)
    starts = np.array([seqs[i].start_pos for i in order], dtype=np.int64)
    ctx_lens = starts + q_lens
    max_blocks = max(cdiv(int(c), block_size) for c in ctx_lens)
    tables = np.zeros((len(order), max_blocks), dtype=np.int32)
    for row, i in enumerate(order):
        ids = seqs[i].block_ids[:max_blocks]
        tables[row, : len(ids)] = ids
    num_tokens = int(q_lens.sum())
    ends = np.cumsum(q_lens)
    seq_of_token = np.repeat(np.arange(len(order)), q_lens)
    positions = np.arange(num_tokens) - np.repeat(ends - q_lens, q_lens) + starts[seq_of_token]
    slots = slot_mapping(tables, seq_of_token, positions, block_size)
    input_ids = np.fromiter((t for i in order for t in seqs[i].token_ids), dtype=np.int64, count=num_tokens)
    logits_rows = np.empty(len(seqs), dtype=np.int64)
    order_idx = np.array(order, dtype=np.int64)
    logits_rows[order_idx] = ends - 1
    first_rows = np.empty(len(seqs), dtype=np.int64)
    first_rows[order_idx] = ends - q_lens

    nd = len(decodes)
    tables_t = torch.from_numpy(tables).to(device)
    ctx_t = torch.from_numpy(ctx_lens.astype(np.int32)).to(device)
    decode = prefill = None
    if nd:
        decode = DecodeMetadata(
            block_tables=tables_t[:nd], context_lens=ctx_t[:nd], max_context_len=int(ctx_lens[:nd].max())
        )
    if len(prefills):
        p_q = q_lens[nd:]
        qsl = np.concatenate(([0], np.cumsum(p_q))).astype(np.int32)
        prefill = PrefillMetadata(
            block_tables=tables_t[nd:],
            query_start_loc=torch.from_numpy(qsl).to(device),
            context_lens=ctx_t[nd:],
            query_lens=p_q.tolist(),
            context_lens_list=ctx_lens[nd:].tolist(),
            max_query_len=int(p_q.max()),
            max_context_len=int(ctx_lens[nd:].max()),
        )
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode_tokens=nd,
        num_prefill_tokens=num_tokens - nd,
        decode=decode,
        prefill=prefill,
    )
    lora_rows = None
    if any(s.lora_slot >= 0 for s in seqs):
        slots = np.array([seqs[i].lora_slot for i in order], dtype=np.int32)
        lora_rows = torch.from_numpy(np.repeat(slots, q_lens)).to(device)
    return StepBatch(
        torch.from_numpy(input_ids).to(device),
        torch.from_numpy(positions).to(device),
        meta,
        torch.from_numpy(logits_rows).to(device),
        first_rows,
        lora_rows,
    )


class ModelRunner:
    def __init__(
        self, model, ops: AttentionOps, kv_caches: torch.Tensor, block_size: int, device="cpu", kv_cache_dtype="auto"
    ):
        self.model = model
        self.ops = ops
        use_kernels(model, ops.quantized_linear)
        ops.prepare_model(model)
        # the pool, [L, 2, num_blocks, ...] (what block copies and swaps move), and what each
        # layer's attention takes of it (kv_cache.layer_caches)
        self.kv_caches = kv_caches
        cfg = model.config
        self.layer_caches = layer_caches(kv_caches, kv_cache_dtype, block_size, model.shards.num_kv_heads, cfg.head_dim)
        self.block_size = block_size
        self.device = device
        # what replays steps (Platform.capture_graphs: gpu.DecodeGraphs, cpu.StepReplay), or None
        self.replay = None
        self.lora = None  # backends/lora.py's LoRASlots where the engine serves adapters

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab], row i for seqs[i]'s last token."""
        return self.execute_with_hidden(seqs)[0]

    @torch.inference_mode()
    def execute_with_hidden(
        self, seqs: list[SeqInput], wanted: dict[int, int] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As `execute`, and for each `wanted` {seq index: count}, the final hidden states of
        that sequence's first `count` tokens of this step ([count, hidden]; see
        CausalLM.compute_logits), for prompt logprobs."""
        last, rest = self.hidden_states(seqs, wanted)
        return self.model.compute_logits(last), rest

    @torch.inference_mode()
    def hidden_states(
        self, seqs: list[SeqInput], wanted: dict[int, int] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final hidden states of each sequence's last token ([len(seqs), hidden]) and of each
        `wanted` sequence's first rows, as execute_with_hidden's: for a caller that computes the
        logits of both in one pass over the LM head (speculative decoding's verification)."""
        replay = self.replay
        if replay is not None and replay.fits(seqs):
            if all(len(s.token_ids) == 1 for s in seqs):  # a decode step: what every replay takes
                hidden = replay.run(seqs)
                return hidden, ({i: hidden[i : i + 1] for i in wanted} if wanted else {})
            # several tokens a request (where fits() takes them): the rows the eager step keeps
            lengths = np.array([len(s.token_ids) for s in seqs])
            starts = np.cumsum(lengths) - lengths
            keep = [starts + lengths - 1, *(np.arange(starts[i], starts[i] + n) for i, n in (wanted or {}).items())]
            hidden = replay.run(seqs, np.concatenate(keep))
            return hidden[: len(seqs)], self._wanted_rows(hidden, len(seqs), wanted)
        batch = prepare_batch(seqs, self.block_size, self.device)
        keep = batch.logits_indices
        if wanted:
            extra = [np.arange(batch.first_rows[i], batch.first_rows[i] + n) for i, n in wanted.items()]
            keep = torch.cat([keep, torch.from_numpy(np.concatenate(extra)).to(self.device)])
        plain = batch.meta.prefill is None and not wanted  # every row is some request's last token
        if self.lora is not None:
            self.lora.set_rows(batch.lora_rows, None if plain else keep)
        if plain:
            hidden = self.model(batch.input_ids, batch.positions, self.layer_caches, batch.meta, self.ops)
            return hidden[keep], {}
        hidden = self.model(batch.input_ids, batch.positions, self.layer_caches, batch.meta, self.ops, keep)
        return hidden[: len(seqs)], self._wanted_rows(hidden, len(seqs), wanted)

    @staticmethod
    def _wanted_rows(hidden: torch.Tensor, at: int, wanted: dict[int, int] | None) -> dict[int, torch.Tensor]:
        """Each wanted sequence's rows of `hidden`, which hold them after the `at` last-token rows."""
        rest = {}
        for i, n in (wanted or {}).items():
            rest[i] = hidden[at : at + n]
            at += n
        return rest


def allocate_kv_caches(
    model, num_blocks: int, block_size: int, dtype=None, device="cpu", kv_cache_dtype="auto"
) -> torch.Tensor:
    """A zeroed KV pool for `model` (a CausalLM: under tensor parallelism, of its own heads)."""
    cfg = model.config
    return allocate_pool(
        kv_cache_dtype,
        cfg.num_layers,
        num_blocks,
        block_size,
        model.shards.num_kv_heads,
        cfg.head_dim,
        dtype or cfg.dtype,
        device,
    )
