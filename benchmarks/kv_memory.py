"""KV memory use on a trace: paged blocks against contiguous per-request reservations.

Runs the real scheduler over a 1,000-request synthetic trace (tokens stand in for a model)
and, after every step, compares the KV slots holding live tokens with
- paged: slots in the blocks the requests hold (only each request's last block is partial);
- contiguous, max-model-len: each running request reserves max_model_len slots up front;
- contiguous, exact: each reserves prompt + its true output length (needs an oracle);
and, every 10 steps, how the blocks are placed (core/outputs.Fragmentation): internal waste,
external fragmentation of the free blocks, and how contiguous the live block tables are — once
per block placement policy.
Run: python -m pagedllm.benchmarks.kv_memory
"""

from __future__ import annotations

from pagedllm.core import CacheConfig, EngineRequest, SamplingParams, Scheduler, SchedulerConfig

from .workload import synthetic_lengths, synthetic_prompts


def measure_kv_utilisation(
    num_requests: int = 1000,
    block_size: int = 16,
    num_blocks: int = 4096,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    seed: int = 0,
    placement: str = "lru",
) -> dict:
    lengths = synthetic_lengths(num_requests, seed=seed)
    prompts = synthetic_prompts(lengths, vocab_size=32000, seed=seed)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=max_model_len),
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False, block_placement=placement
        ),
    )
    final_len = {}
    for i, (prompt, (_, out_len)) in enumerate(zip(prompts, lengths)):
        sched.add_request(
            EngineRequest(
                request_id=str(i),
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=out_len, ignore_eos=True),
            )
        )
        final_len[str(i)] = len(prompt) + out_len
    live = paged = contiguous_max = contiguous_exact = 0
    steps = 0
    series = []  # per step: (live tokens, paged slots, contiguous max_model_len slots)
    samples = []  # Fragmentation every 10 steps
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update(plan, {rid: 11 for rid in plan.num_scheduled_tokens})
        steps += 1
        running = sched.running
        step_live = sum(r.num_computed_tokens for r in running)
        live += step_live
        paged += sched.kv.pool.num_used * block_size
        contiguous_max += len(running) * max_model_len
        contiguous_exact += sum(final_len[r.request_id] for r in running)
        series.append((step_live, sched.kv.pool.num_used * block_size, len(running) * max_model_len))
        if steps % 10 == 0 and running:
            samples.append(sched.fragmentation())
    mean = lambda field: sum(getattr(f, field) for f in samples) / len(samples)
    return {
        "requests": num_requests,
        "steps": steps,
        "block_size": block_size,
        "mean_prompt": sum(p for p, _ in lengths) / num_requests,
        "mean_output": sum(o for _, o in lengths) / num_requests,
        "paged": live / paged,
        "contiguous_max_model_len": live / contiguous_max,
        "contiguous_exact_length": live / contiguous_exact,
        "preemptions": sched.num_preemptions,
        "placement": placement,
        "internal_waste": mean("internal_waste"),
        "external_fragmentation": mean("external"),
        "mean_table_run": mean("mean_table_run"),
        "series": series,
    }


def print_placements(rows: list[dict]) -> None:
    head = f"{'placement':<10} {'table run (blocks)':>18} {'internal waste':>15} {'external frag.':>15}"
    head += f" {'preemptions':>12}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['placement']:<10} {r['mean_table_run']:18.1f} {r['internal_waste']:15.1%} "
            f"{r['external_fragmentation']:15.1%} {r['preemptions']:12d}"
        )


def main():
    from pagedllm.core.config import PLACEMENTS

    rows = [measure_kv_utilisation(placement=p) for p in PLACEMENTS]
    r = rows[0]
    print(
        f"trace: {r['requests']} requests, mean prompt {r['mean_prompt']:.0f}, mean output "
        f"{r['mean_output']:.0f} tokens, {r['steps']} steps, {r['preemptions']} preemptions"
    )
    print("share of allocated KV slots holding live tokens:")
    print(f"  paged (block size {r['block_size']}):             {r['paged']:.1%}")
    print(f"  contiguous, max_model_len per request: {r['contiguous_max_model_len']:.1%}")
    print(f"  contiguous, exact final length:        {r['contiguous_exact_length']:.1%}")
    print_placements(rows)


if __name__ == "__main__":
    main()


def kv_capacity(model_dir: str, dtype: str, kv_cache_memory: int, context: int = 2048, block_size: int = 16):
    """For each KV cache dtype: bytes per token of `model_dir`'s KV, the blocks `kv_cache_memory`
    buys, and how many requests of `context` tokens those blocks hold."""
    from pagedllm.core.config import KV_CACHE_ALIASES, KV_CACHE_DTYPES
    from pagedllm.core.model_folder import model_folder
    from pagedllm.core.protocol import KVSpec
    from pagedllm.core.utils import cdiv

    cfg = model_folder(model_dir).config
    heads = cfg["num_attention_heads"]
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rows = []
    for kv in (k for k in KV_CACHE_DTYPES if k not in KV_CACHE_ALIASES):
        spec = KVSpec(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, head_size, dtype, kv)
        blocks = kv_cache_memory // (spec.bytes_per_block_slot * block_size)
        rows.append(
            {
                "kv_cache_dtype": kv,
                "bytes_per_token": spec.bytes_per_block_slot,
                "blocks": blocks,
                "requests_at_context": (blocks - 1) // cdiv(context, block_size),
                "context": context,
            }
        )
    return rows


def print_capacity(rows: list[dict], kv_cache_memory: int, dtype: str) -> None:
    print(f"\nKV cache dtypes: what {kv_cache_memory / 2**20:.0f} MiB of KV pool holds ({dtype} model)")
    print(f"  {'kv_cache_dtype':16} {'bytes/token':>12} {'blocks':>8} {'requests':>9}")
    auto = rows[0]["requests_at_context"]
    for r in rows:
        ratio = f"  ({r['requests_at_context'] / auto:.2f}x)" if auto else ""
        print(
            f"  {r['kv_cache_dtype']:16} {r['bytes_per_token']:12,d} {r['blocks']:8,d} "
            f"{r['requests_at_context']:9,d} at {r['context']:,} tokens{ratio}"
        )
