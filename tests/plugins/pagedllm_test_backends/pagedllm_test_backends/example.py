"""A minimal third-party backend written against the public interface only: one loop per
request, torch's scaled_dot_product_attention on the gathered blocks — and a platform face of
its own, as a port to an accelerator that is neither CUDA nor a CPU fills it: the KV pool in
its own ("device") memory, sized by its own memory query, its own choice of distributed
backend and default dtype, and its own graph hook. Each platform hook the worker calls is
written, with the process id, to the file $PAGEDLLM_TEST_PLATFORM_LOG names (when set), so
that tests can see the worker ask the backend rather than decide for it."""

import os

import torch
import torch.nn.functional as F

from pagedllm.backends.attention import AttentionOps
from pagedllm.backends.runner import prepare_batch

DEVICE_MEMORY = 64 << 20  # what the "device" reports, unless $PAGEDLLM_TEST_DEVICE_MEMORY says


def _log(hook: str, detail: str = "") -> None:
    path = os.environ.get("PAGEDLLM_TEST_PLATFORM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {hook} {detail}".rstrip() + "\n")


class EagerReplay:
    """The plugin's graph hook: decode steps "replayed" (run eagerly, counted)."""

    def __init__(self, model, ops, kv_caches, block_size):
        self.model, self.ops, self.kv_caches, self.block_size = model, ops, kv_caches, block_size
        self.replays = 0

    def fits(self, seqs) -> bool:
        return all(len(s.token_ids) == 1 for s in seqs)

    def run(self, seqs):
        if self.replays == 0:
            _log("graph_replay")
        self.replays += 1
        batch = prepare_batch(seqs, self.block_size, self.kv_caches.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.ops)
        return hidden[batch.logits_indices]


class ExampleOps(AttentionOps):
    name = "example"
    contract_version = 2
    supported_dtypes = (torch.float32, torch.bfloat16)
    kv_in_shared_memory = False  # its pool is its own, so recovery recomputes

    @property
    def distributed_backend(self) -> str:
        _log("distributed_backend", "gloo")
        return "gloo"  # what this machine's torch has; a real port names its own

    def set_device(self, rank, ranks_per_host):
        _log("set_device", f"rank={rank} ranks_per_host={ranks_per_host}")
        super().set_device(rank, ranks_per_host)

    def seed(self, seed):
        _log("seed", str(seed))
        super().seed(seed)

    def default_dtype(self, model_dir, requested):
        chosen = "bfloat16" if requested == "auto" else requested  # this "device" prefers 16 bits
        _log("default_dtype", f"{requested}->{chosen}")
        return chosen

    def kv_cache_blocks(self, model, block_size, slot_bytes, max_batched_tokens, max_seq_len, utilization, device):
        memory = int(os.environ.get("PAGEDLLM_TEST_DEVICE_MEMORY", DEVICE_MEMORY))
        blocks = int(memory * utilization) // (slot_bytes * block_size)
        _log("kv_cache_blocks", str(blocks))
        return blocks

    def pin_memory(self, tensor):
        _log("pin_memory", str(tensor.numel()))

    def capture_graphs(self, model, kv_caches, block_size, max_batch, max_model_len):
        _log("capture_graphs", f"max_batch={max_batch}")
        return EagerReplay(model, self, kv_caches, block_size)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        heads, size = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, heads, size)[slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(-1, heads, size)[slot_mapping] = value.to(kv_cache.dtype)

    def _one(self, q, kv_cache, blocks, context_len, scale):
        """q [L, H, D] for the last L positions of a context_len-token sequence."""
        _, _, _, kv_heads, size = kv_cache.shape
        k = kv_cache[0][blocks].reshape(-1, kv_heads, size)[:context_len].float()
        v = kv_cache[1][blocks].reshape(-1, kv_heads, size)[:context_len].float()
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q_len = q.shape[0]
        allowed = torch.arange(context_len)[None, :] <= torch.arange(context_len - q_len, context_len)[:, None]
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
        )
        return out.transpose(0, 1).to(q.dtype)

    def decode_attention(self, query, kv_cache, meta, scale):
        bs = kv_cache.shape[2]
        outs = []
        for i, ctx in enumerate(meta.context_lens.tolist()):
            blocks = meta.block_tables[i, : -(-ctx // bs)].long()
            outs.append(self._one(query[i : i + 1], kv_cache, blocks, ctx, scale))
        return torch.cat(outs)

    def prefill_attention(self, query, kv_cache, meta, scale):
        bs = kv_cache.shape[2]
        outs, start = [], 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            blocks = meta.block_tables[i, : -(-ctx // bs)].long()
            outs.append(self._one(query[start : start + q_len], kv_cache, blocks, ctx, scale))
            start += q_len
        return torch.cat(outs)
