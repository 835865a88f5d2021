"""Weight quantization on the cpu backend, mode by mode, against the unquantized model.

- Quality: the demo model's held-out loss (the held-out pydoc topics of
  tools/train_demo_model.py, as tests/test_demo_model.py scores them) in bfloat16 and in each
  mode, and each mode's greedy agreement with bfloat16.
- Speed and memory: a random Llama of 100M+ parameters made here (hidden 1024, 9 layers, 16
  heads, 8 KV heads, intermediate 2816, vocabulary 8192: the decoder layers' projections are
  95% of the weights): bytes of weights, the median decode step at several batch sizes
  (steps of all modes interleaved, so the machine's drift hits them alike), and generation
  throughput through the engine, each against bfloat16 in the same run.

Run: python -m pagedllm.benchmarks.bench_quantization [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

from pagedllm.backends.cpu import CpuAttentionOps
from pagedllm.backends.cpu.packed_linear import PackedLinear
from pagedllm.backends.models.loader import load_model
from pagedllm.backends.runner import ModelRunner, SeqInput, allocate_kv_caches, prepare_batch
from pagedllm.benchmarks.report import agreement
from pagedllm.core.quantization import ON_THE_FLY
from pagedllm.core.utils import cdiv

from .bench_decode_step import scratch_dir

BLOCK = 16
MODES = (None, *ON_THE_FLY)  # None: the checkpoint's own weights


def mode_name(mode: str | None, dtype: str) -> str:
    return dtype if mode is None else f"{mode} ({dtype} compute)"


def make_runner(
    model_dir: str, dtype: str, mode: str | None, num_blocks: int, kv_cache_dtype: str = "auto"
) -> ModelRunner:
    model = load_model(model_dir, dtype=dtype, quantization=mode)
    kv = allocate_kv_caches(model, num_blocks, BLOCK, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(model, CpuAttentionOps(), kv, BLOCK, kv_cache_dtype=kv_cache_dtype)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights take as the backend holds them: parameters and buffers (tied ones
    once, the rotary tables not counted), and weights oneDNN packed (PackedLinear: not a buffer;
    the panel kernel's packed weights are buffers, counted with them)."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        if name == "rope":
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        if isinstance(module, PackedLinear):  # an opaque oneDNN tensor: count the weight it holds
            total += module.in_features * module.out_features * model.config.dtype.itemsize
    return total


@torch.inference_mode()
def sequence_scores(runner: ModelRunner, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Summed negative log-likelihood of ids[1:] given what precedes each, in one prefill, and
    the model's top token at each position."""
    table = list(range(1, cdiv(len(ids), BLOCK) + 1))
    batch = prepare_batch([SeqInput(ids[:-1], 0, table)], BLOCK)
    hidden = runner.model(batch.input_ids, batch.positions, runner.layer_caches, batch.meta, runner.ops)
    logits = runner.model.compute_logits(hidden)
    nll = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
    return nll, logits.argmax(-1)


def demo_held_out(tokenizer) -> list[list[int]]:
    """The demo model's held-out texts (every 10th pydoc topic, never trained on) as chunks of
    257 tokens: the set tests/test_demo_model.py and tests/test_quantization.py score."""
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "train_demo_model.py")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    chunks = []
    for text in script.held_out_texts():
        ids = tokenizer.encode(text)
        chunks += [ids[s : s + 257] for s in range(0, len(ids) - 1, 256) if len(ids[s : s + 257]) >= 2]
    return chunks


def held_out_scores(model_dir: str, dtype: str, mode: str | None, chunks: list[list[int]], kv_cache_dtype="auto"):
    """Nats per token over the chunks, and the top token at every position."""
    runner = make_runner(model_dir, dtype, mode, cdiv(257, BLOCK) + 1, kv_cache_dtype)
    scores = [sequence_scores(runner, c) for c in chunks]
    return sum(nll for nll, _ in scores) / sum(len(c) - 1 for c in chunks), torch.cat([top for _, top in scores])


def held_out_loss(
    model_dir: str, dtype: str, mode: str | None, chunks: list[list[int]], kv_cache_dtype="auto"
) -> float:
    return held_out_scores(model_dir, dtype, mode, chunks, kv_cache_dtype)[0]


@torch.inference_mode()
def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together."""
    each = cdiv(max(map(len, prompts)) + new_tokens, BLOCK)
    tables = [list(range(1 + i * each, 1 + (i + 1) * each)) for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    seqs = [SeqInput(p, 0, t) for p, t in zip(prompts, tables)]
    for _ in range(new_tokens):
        for t, nxt in zip(tokens, runner.execute(seqs).argmax(-1).tolist()):
            t.append(nxt)
        seqs = [SeqInput(t[-1:], len(t) - 1, tab) for t, tab in zip(tokens, tables)]
    return [t[len(p) :] for t, p in zip(tokens, prompts)]


def quality(quick: bool) -> list[dict]:
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.default_model import shipped_model_dir

    demo = shipped_model_dir()
    tok = AutoTokenizer.from_pretrained(demo)
    chunks = demo_held_out(tok)[: 8 if quick else None]
    prompts = [tok.encode(p) for p in ("The for statement", "A dictionary is", "def", "Exceptions are")]
    rows, reference = [], None
    for mode in MODES:
        loss, top = held_out_scores(demo, "bfloat16", mode, chunks)
        out = greedy(make_runner(demo, "bfloat16", mode, 64), prompts, 16 if quick else 48)
        reference = reference or (loss, top, out)
        rows.append(
            {
                "mode": mode_name(mode, "bfloat16"),
                "held_out_loss": loss,
                "vs_bfloat16": loss / reference[0],
                "top1_agreement": float((top == reference[1]).float().mean()),
                "greedy_agreement": agreement(reference[2], out),
            }
        )
        print(
            f"  {rows[-1]['mode']:24s} loss {loss:.4f} ({loss / reference[0] - 1:+.2%}), same top token as "
            f"bfloat16 at {rows[-1]['top1_agreement']:.1%} of held-out positions, greedy continuations agree "
            f"for {rows[-1]['greedy_agreement']:.0%} of their tokens (up to the first difference)",
            flush=True,
        )
    return rows


def big_llama_dir(path: str, quick: bool) -> str:
    """Random weights in bfloat16; --quick: a 2-layer, hidden-256 stand-in."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    big = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9, vocab_size=8192)
    small = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, vocab_size=4096)
    cfg = LlamaConfig(
        **(small if quick else big),
        num_attention_heads=16 if not quick else 4,
        num_key_value_heads=8 if not quick else 2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@torch.inference_mode()
def decode_steps(configs: list[tuple[str, str | None]], model_dir, batch: int, context: int, steps: int) -> dict:
    """Median decode-step seconds per (dtype, mode) at `batch` requests of `context` tokens."""
    each = cdiv(context + steps + 4, BLOCK)
    runners, states = {}, {}
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 4000, (batch, context), generator=gen).tolist()
    for dtype, mode in configs:
        # no prefill: a decode step's time does not depend on what the cache holds
        runner = make_runner(model_dir, dtype, mode, 1 + batch * each)
        tables = [list(range(1 + i * each, 1 + (i + 1) * each)) for i in range(batch)]
        runners[(dtype, mode)], states[(dtype, mode)] = runner, ([list(p) for p in prompts], tables)
    times = {c: [] for c in configs}
    for _ in range(steps):
        for c in configs:
            tokens, tables = states[c]
            seqs = [SeqInput(t[-1:], len(t) - 1, tab) for t, tab in zip(tokens, tables)]
            t0 = time.perf_counter()
            nxt = runners[c].execute(seqs).argmax(-1).tolist()
            times[c].append(time.perf_counter() - t0)
            for t, n in zip(tokens, nxt):
                t.append(n)
    return {c: statistics.median(v) for c, v in times.items()}


def throughput(model_dir: str, dtype: str, mode: str | None, requests: int, new_tokens: int) -> float:
    """Output tokens per second generating `new_tokens` for each of `requests` prompts."""
    from pagedllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 4000, (64,), generator=gen).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(model_dir, dtype=dtype, quantization=mode, skip_tokenizer_init=True, kv_cache_memory="1GiB") as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def speed(quick: bool) -> list[dict]:
    model_dir = big_llama_dir(scratch_dir(), quick)
    configs = [("bfloat16", None), ("float32", None)] + [("bfloat16", m) for m in ON_THE_FLY]
    configs += [("float32", m) for m in ON_THE_FLY]
    batches = (1, 16) if quick else (1, 16, 64)
    steps = {b: decode_steps(configs, model_dir, b, 64 if quick else 256, 3 if quick else 12) for b in batches}
    rows = []
    parameters = sum(p.numel() for p in load_model(model_dir).parameters())
    for dtype, mode in configs:
        model = load_model(model_dir, dtype=dtype, quantization=mode)
        ModelRunner(model, CpuAttentionOps(), allocate_kv_caches(model, 1, BLOCK), BLOCK)  # the backend's layers
        tok_s = throughput(model_dir, dtype, mode, 8 if quick else 32, 8 if quick else 64)
        rows.append(
            {
                "mode": mode_name(mode, dtype),
                "parameters": parameters,
                "weight_bytes": weight_bytes(model),
                "decode_step_ms": {b: steps[b][(dtype, mode)] * 1e3 for b in batches},
                "output_tok_s": tok_s,
            }
        )
    base = rows[0]
    head = f"{'mode':28s} {'weights':>9s} " + " ".join(f"{'step @' + str(b):>14s}" for b in batches)
    print(head + f" {'tok/s':>14s}")
    for r in rows:
        cells = " ".join(
            f"{r['decode_step_ms'][b]:7.1f} {base['decode_step_ms'][b] / r['decode_step_ms'][b]:5.2f}x" for b in batches
        )
        print(
            f"{r['mode']:28s} {r['weight_bytes'] / 2**20:6.0f}MiB {cells} "
            f"{r['output_tok_s']:7.1f} {r['output_tok_s'] / base['output_tok_s']:5.2f}x",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    CpuAttentionOps().prepare_process()  # the allocator settings of a worker process
    print("quality: the demo model, bfloat16 compute")
    q = quality(args.quick)
    print("speed: decode-step medians (ms, and bfloat16's time over the mode's), engine throughput")
    s = speed(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "quality": q, "speed": s}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
