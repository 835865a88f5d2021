"""One decode step for 32 requests at 512-token contexts: pagedllm's runner (cpu backend,
paged KV) against transformers' own forward with its own KV cache, same weights, same script;
and the share of the cores' peak float32 FLOP/s the step reaches (what is left to win).

Run: python -m pagedllm.benchmarks.bench_decode_step [--dtype float32|bfloat16] [--steps 20]

With --kv-cache-dtype int8,fp8_e4m3,... it compares KV cache dtypes instead (the model's dtype,
`auto`, first): decode attention alone (one layer) and the whole decode step at --batch x
--context, alternated round by round, and the requests of --context tokens a 256 MiB pool holds.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import shutil
import statistics
import tempfile

import torch

from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.kv_cache import split_layer_cache
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches
from pagedllm.core.protocol import KVSpec
from pagedllm.core.utils import cdiv
from pagedllm.fixtures.small_llama import small_llama_dir

from .machine import time_steps


def scratch_dir() -> str:
    """A temporary folder for a generated model, removed when the script exits."""
    path = tempfile.mkdtemp(prefix="pagedllm-bench-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def decode_step_flops(cfg, batch: int, context: int) -> float:
    """FLOPs (2 per multiply-add) of one decode step: every weight once per request (the LM head
    included, the embedding lookup not), and attention's q.k and p.v over the context."""
    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * cfg.intermediate_size
    attention = 2 * heads * d * context
    return 2.0 * batch * (cfg.num_hidden_layers * (per_layer + attention) + h * cfg.vocab_size)


def nominal_flops_per_cycle(flags: set[str], vendor: str, family: int) -> int:
    """float32 FLOPs per core and cycle: two FMA pipes of the widest vector unit. AVX-512 is
    512 bits wide on Intel's server cores and AMD's Zen 5 (family 26) on, but runs on 256-bit
    pipes on Zen 4; AVX2 with FMA is 32, without FMA a 256-bit multiply and add, 16."""
    if "avx512f" in flags and (vendor == "GenuineIntel" or family >= 26):
        return 64
    return 32 if "fma" in flags else 16


def measured_gemm_flops() -> float:
    """The best float32 rate of a large oneDNN GEMM (2048 x 1024 x 1024, packed weight) of five:
    a floor under the peak, for virtual machines whose reported clock is the base clock."""
    from pagedllm.backends.cpu.packed_linear import pack_weight, packed_linear, packing_available

    x, w = torch.randn(2048, 1024), torch.randn(1024, 1024)
    matmul = functools.partial(packed_linear, x, pack_weight(w), None) if packing_available() else lambda: x @ w.T
    matmul()
    return 2 * 2048 * 1024 * 1024 / min(time_steps(matmul, 5))


def cpu_peak_flops() -> tuple[float, str]:
    """This machine's float32 peak and how it was reckoned: cores x FLOPs per cycle
    (nominal_flops_per_cycle) x the highest clock the kernel reports, or the measured GEMM
    rate where that is higher (the reported clock is below the boost clock)."""
    info: dict[str, str] = {}
    mhz = 0.0
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "cpu MHz":
                mhz = max(mhz, float(value))
            info.setdefault(key, value)
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz = max(mhz, int(f.read()) / 1000)
    except OSError:
        pass
    per_cycle = nominal_flops_per_cycle(
        set(info.get("flags", "").split()), info.get("vendor_id", ""), int(info.get("cpu family", "0") or 0)
    )
    cores = torch.get_num_threads()
    nominal = cores * per_cycle * mhz * 1e6
    how = f"{cores} cores x {per_cycle} FLOP/cycle x {mhz / 1000:.2f} GHz = {nominal / 1e9:.0f} GFLOP/s"
    measured = measured_gemm_flops()
    if measured > nominal:
        return measured, f"a measured float32 GEMM's {measured / 1e9:.0f} GFLOP/s, above the nominal {how}"
    return nominal, f"{how}; a float32 GEMM measured {measured / 1e9:.0f}"


def filled_runner(model, kv_dtype: str, tables, context: int, bs: int, num_blocks: int) -> ModelRunner:
    """A runner whose pool holds `context` tokens of random K/V for every request (the timing of
    a decode step does not depend on what the K/V is)."""
    cfg = model.config
    kv = allocate_kv_caches(model, num_blocks, bs, kv_cache_dtype=kv_dtype)
    runner = ModelRunner(model, CpuAttentionOps(), kv, bs, kv_cache_dtype=kv_dtype)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t in tables for p in range(context)])
    gen = torch.Generator().manual_seed(1)
    shape = (cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        cache, extra = split_layer_cache(runner.layer_caches[layer])
        for chunk in slots.split(8192):
            k, v = (torch.randn(len(chunk), *shape, generator=gen).to(cfg.dtype) for _ in range(2))
            runner.ops.write_kv(k, v, cache, chunk, **extra)
    return runner


@torch.inference_mode()
def compare_kv_cache_dtypes(args) -> None:
    path = small_llama_dir(scratch_dir(), args.dtype)
    model = load_model(path)
    cfg, bs = model.config, 16
    kinds = ["auto", *args.kv_cache_dtype.split(",")]
    blocks_each = cdiv(args.context, bs)
    num_blocks = 1 + args.batch * blocks_each
    ids = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    tables = [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(args.batch)]
    seqs = [SeqInput([7], args.context - 1, t) for t in tables]  # the context's last token
    query = torch.randn(args.batch, cfg.num_heads, cfg.head_dim).to(cfg.dtype)
    width = torch.tensor(tables, dtype=torch.int32)
    meta = DecodeMetadata(width, torch.full((args.batch,), args.context, dtype=torch.int32), args.context)
    attention, steps = {}, {}
    for kind in kinds:
        runner = filled_runner(model, kind, tables, args.context, bs, num_blocks)
        cache, extra = split_layer_cache(runner.layer_caches[0])
        attention[kind] = functools.partial(runner.ops.decode_attention, query, cache, meta, 0.1, **extra)
        steps[kind] = functools.partial(runner.execute, seqs)
    times = {kind: ([], []) for kind in kinds}
    for _ in range(args.steps):  # alternated, so that the machine's drift hits every dtype alike
        for kind in kinds:
            times[kind][0].extend(time_steps(attention[kind], 3))
            times[kind][1].extend(time_steps(steps[kind], 1))
    base = {i: statistics.median(times["auto"][i]) for i in (0, 1)}
    print(f"{args.batch} requests x {args.context}-token contexts, {args.dtype} model, median of {args.steps} rounds:")
    print(
        f"  {'KV cache dtype':16} {'attention (1 layer)':>20} {'x auto':>7} {'decode step':>12} {'x auto':>7} "
        f"{'requests / 256 MiB':>19}"
    )
    for kind in kinds:
        att, step = (statistics.median(times[kind][i]) for i in (0, 1))
        slot = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.dtype, kind).bytes_per_block_slot
        fits = (256 << 20) // (slot * bs) // blocks_each
        print(
            f"  {kind:16} {att * 1e3:17.2f} ms {base[0] / att:6.2f}x {step * 1e3:9.1f} ms {base[1] / step:6.2f}x "
            f"{fits:19d}"
        )


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", help="compare these KV cache dtypes (comma-separated) with auto")
    args = ap.parse_args(argv)
    if args.kv_cache_dtype:
        return compare_kv_cache_dtypes(args)
    path = small_llama_dir(scratch_dir(), args.dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 32000, (args.batch, args.context), generator=gen)
    bs = 16

    # pagedllm: prefill every request, then time decode steps
    model = load_model(path)
    blocks_each = cdiv(args.context + args.steps + 2, bs)
    kv = allocate_kv_caches(model, 1 + args.batch * blocks_each, bs)
    runner = ModelRunner(model, CpuAttentionOps(), kv, bs)
    # scattered blocks, as in a pool that has served many requests
    ids = (torch.randperm(args.batch * blocks_each, generator=gen) + 1).tolist()
    tables = [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(args.batch)]
    tokens = [p.tolist() for p in prompts]
    for i in range(args.batch):
        logits = runner.execute([SeqInput(tokens[i], 0, tables[i])])
        tokens[i].append(int(logits[0].argmax()))

    def paged_step():
        seqs = [SeqInput(t[-1:], len(t) - 1, tab) for t, tab in zip(tokens, tables)]
        out = runner.execute(seqs).argmax(-1).tolist()
        for t, nxt in zip(tokens, out):
            t.append(nxt)

    # transformers: one padded-free batch (equal lengths), its DynamicCache
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    out = hf(prompts, cache=cache, use_cache=True)
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def hf_step():
        o = hf(state["next"], cache=cache, use_cache=True)
        state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)

    # alternate the two, step by step, so that the machine's drift hits both alike
    paged_step()
    hf_step()
    ours, theirs = [], []
    for _ in range(args.steps):
        ours += time_steps(paged_step, 1)
        theirs += time_steps(hf_step, 1)
    ours_ms, theirs_ms = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
    print(f"decode step, {args.batch} requests x {args.context}-token context, {args.dtype}, median of {args.steps}:")
    print(f"  pagedllm runner (cpu backend): {ours_ms:8.1f} ms")
    print(f"  transformers forward + cache:  {theirs_ms:8.1f} ms")
    print(f"  ratio (transformers / pagedllm): {theirs_ms / ours_ms:.2f}x")
    flops = decode_step_flops(hf.config, args.batch, args.context)
    peak, how = cpu_peak_flops()
    achieved = flops / (ours_ms / 1e3)
    print(
        f"  pagedllm: {flops / 1e9:.2f} GFLOP per step, {achieved / 1e9:.1f} GFLOP/s = "
        f"{achieved / peak:.0%} of the float32 peak ({how}; os.cpu_count() {os.cpu_count()})"
    )


if __name__ == "__main__":
    main()
