"""Multi-LoRA benchmark: one batch of requests spread over 1, 4 and 8 adapters of rank 16 against
the same batch on the base model alone, in turns in one run (the median of the rounds counts),
with the machine record; and what max_loras costs in memory (the stacked slot weights).

    python -m pagedllm.benchmarks.bench_lora [--model DIR] [--requests 64] [--rounds 3]

"base, LoRA off" is an engine without enable_lora; "base, LoRA on" the LoRA engine's rows without
an adapter (both replay their steps on the cpu backend). Goal: 4 adapters at rank 16 cost at most
1.3x the base step."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from pagedllm.benchmarks.machine import describe, finish, machine_record
from pagedllm.core.lora import TARGETS, module_shapes
from pagedllm.core.model_folder import model_folder

RANK = 16


def write_adapter(model_dir: str, out: str, seed: int, rank: int = RANK) -> str:
    """A random PEFT-format adapter of every projection (what PEFT saves, without PEFT)."""
    config = model_folder(model_dir).config
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (width_in, width_out) in module_shapes(config).items():
            where = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, rank, generator=gen) * 0.02
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return out


def slot_bytes(model_dir: str, rank: int = RANK, itemsize: int = 4) -> int:
    """Bytes one adapter slot holds: A and B of every projection of every layer."""
    config = model_folder(model_dir).config
    per_layer = sum(rank * (i + o) for i, o in module_shapes(config).values())
    return per_layer * config["num_hidden_layers"] * itemsize


def main(argv=None) -> int:
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.entrypoints.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    model = args.model or default_model_dir()
    machine = machine_record()
    work = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(model, f"{work}/a{i}", i)) for i in range(8)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (32,), generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    settings = {"base, LoRA off": None, "base, LoRA on": [None] * args.requests}
    for count in (1, 4, 8):
        settings[f"{count} adapter{'s' if count > 1 else ''}"] = [adapters[i % count] for i in range(args.requests)]
    times: dict[str, list[float]] = {name: [] for name in settings}
    common = dict(dtype=args.dtype, skip_tokenizer_init=True, max_model_len=256)
    with LLM(model, **common) as plain, LLM(model, enable_lora=True, max_loras=8, max_lora_rank=RANK, **common) as lora:
        for chosen in settings.values():  # a warm-up round: adapters loaded, kernels built
            (plain if chosen is None else lora).generate(prompts, params, use_tqdm=False, lora_request=chosen)
        for _ in range(args.rounds):
            for name, chosen in settings.items():
                start = time.perf_counter()
                (plain if chosen is None else lora).generate(prompts, params, use_tqdm=False, lora_request=chosen)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["base, LoRA off"])
    tokens = args.requests * params.max_tokens
    print(f"{args.requests} requests x {params.max_tokens} tokens, rank {RANK}, {args.dtype}, {args.rounds} rounds")
    print(f"{'setting':<16} {'tok/s':>8} {'x base':>7}  per round (s)")
    for name, runs in times.items():
        median = statistics.median(runs)
        rounds = ", ".join(f"{t:.2f}" for t in runs)
        print(f"{name:<16} {tokens / median:8.0f} {median / base:7.2f}  {rounds}")
    size = slot_bytes(model)
    print(f"max_loras costs {size / 2**20:.2f} MiB per slot (float32 A and B of every projection at rank {RANK})")
    print(describe(finish(machine)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
