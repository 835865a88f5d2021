"""`pagedllm bench throughput|latency|serving|scaling|memory|replicas`, the one front door of these
benchmarks: one workload through pagedllm and its peers, side by side, with a table on the
terminal, a JSON file and PNG plots in --out. Each mode's work is in its module here
(bench_throughput, bench_latency, bench_serving, kv_memory); the others have their own
`python -m pagedllm.benchmarks.NAME`."""

from __future__ import annotations

import json
import os
import time

from pagedllm.core.config import parse_size


def load_dataset(spec: str, num: int, seed: int, tokenizer, vocab_size: int, max_len: int = 2048):
    """('synthetic' | 'uniform' | a JSONL path) -> (prompt token ids, requested output lengths).
    Synthetic prompt and output lengths are each clipped to half the model's context; uniform
    ones are 16-256 each. A JSONL file's token ids past the vocabulary are taken modulo it."""
    if spec in ("synthetic", "uniform"):
        from .workload import synthetic_lengths, synthetic_prompts, uniform_lengths

        if spec == "uniform":
            lengths = uniform_lengths(num, seed=seed, hi=min(256, max_len // 2 - 1))
        else:
            lengths = synthetic_lengths(num, seed=seed, max_len=min(1000, max_len // 2 - 1))
        return synthetic_prompts(lengths, vocab_size, seed), [o for _, o in lengths]
    prompts, outs, folded = [], [], 0
    with open(spec) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
                folded += sum(not 0 <= t < vocab_size for t in ids)
                ids = [t % vocab_size for t in ids]  # a dataset written for a larger vocabulary still runs
            elif "prompt" in row and tokenizer is not None:
                ids = tokenizer.encode(row["prompt"])
            else:
                raise ValueError(f"--dataset: line {lineno} needs 'prompt' or 'prompt_token_ids'")
            out = row.get("output_len", row.get("max_tokens"))
            if not isinstance(out, int) or out < 1:
                raise ValueError(f"--dataset: line {lineno} needs a positive 'output_len'")
            prompts.append(ids)
            outs.append(out)
            if len(prompts) == num:
                break
    if not prompts:
        raise ValueError(f"--dataset: no requests in {spec}")
    if folded:
        print(f"--dataset: {folded} token ids past the model's vocabulary of {vocab_size} taken modulo it")
    return prompts, outs


def _token_workload(args):
    """(model folder, prompt token ids, output lengths) for the modes that need no tokenizer."""
    from pagedllm.core.model_folder import model_folder

    model_dir = model_dir_of(args)
    folder = model_folder(model_dir)
    prompts, max_tokens = load_dataset(
        args.dataset, args.num_prompts, args.seed, None, folder.vocab_size, folder.max_position_embeddings
    )
    return model_dir, prompts, max_tokens


RANDOM_MODEL_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "experts": "num_local_experts",  # a Mixtral (its window off), with top_k experts a token
    "top_k": "num_experts_per_tok",
}


def random_model(spec: str, out_dir: str) -> str:
    """`random:layers=2,hidden=192[,intermediate=,heads=,kv_heads=,vocab=,experts=,top_k=]`: a
    seeded random-weight Llama folder (fixtures/tiny_models.py) — a Mixtral with `experts` —
    written once under out_dir: small models that anyone can rebuild exactly. Defaults:
    intermediate 8/3 x hidden rounded up to 64 (each expert's, for a Mixtral), 4 heads, 2 KV
    heads, a 400-token vocabulary, top-2 routing."""
    from pagedllm.fixtures.tiny_models import make_model_dir

    values = dict(part.split("=", 1) for part in spec.removeprefix("random:").split(",") if part)
    unknown = set(values) - set(RANDOM_MODEL_KEYS) - {"vocab"}
    if unknown:
        raise ValueError(f"--model {spec}: unknown key(s) {sorted(unknown)}; known: {[*RANDOM_MODEL_KEYS, 'vocab']}")
    sizes = {RANDOM_MODEL_KEYS[k]: int(v) for k, v in values.items() if k != "vocab"}
    hidden = sizes.setdefault("hidden_size", 64)
    sizes.setdefault("intermediate_size", -(-hidden * 8 // 3 // 64) * 64)
    name = "random-" + "-".join(f"{k}{v}" for k, v in sorted(values.items()))
    arch = "llama"
    if "num_local_experts" in sizes:
        arch = "mixtral"
        sizes.setdefault("num_experts_per_tok", 2)
        sizes.update(sliding_window=None, head_dim=hidden // sizes.get("num_attention_heads", 4))
    elif "num_experts_per_tok" in sizes:
        raise ValueError(f"--model {spec}: top_k needs experts")
    vocab = int(values.get("vocab", 400))
    # the tokenizer is trained on a small text and stops short of a large vocabulary; the
    # embedding and LM head have `vocab` rows all the same, as a model padding its vocabulary has
    return make_model_dir(os.path.join(out_dir, name), arch, vocab_size=vocab, model_vocab_size=vocab, **sizes)


def model_dir_of(args) -> str:
    from pagedllm.entrypoints.default_model import default_model_dir

    if args.model and args.model.startswith("random:"):
        return random_model(args.model, args.out)
    return args.model or default_model_dir()


def _write_json(args, path: str, payload: dict) -> None:
    """A mode's results, with the machine they were measured on (benchmarks/machine.py)."""
    from . import report
    from .machine import finish

    report.write_json(path, {**payload, "machine": finish(args.machine)})


def cmd_bench(args) -> int:
    from .machine import busy_processes, describe, finish, machine_record

    peers = _throughput_peers(args) if args.mode == "throughput" else []  # before the probe: a wrong flag fails fast
    args.machine = {**machine_record(), "busy_processes": args.busy}  # probed before the busy ones start
    with busy_processes(args.busy):
        code = _run_mode(args, peers)
    print(describe(finish(args.machine)) + (f"; {args.busy} busy processes beside the run" if args.busy else ""))
    return code


def _run_mode(args, peers: list[str]) -> int:
    from . import report

    out_dir = report.ensure_dir(args.out)
    if args.mode == "latency":
        return _latency(args, out_dir)
    if args.mode == "scaling":
        return _scaling(args, out_dir)
    if args.mode == "serving":
        return _serving(args, out_dir)
    if args.mode == "replicas":
        return _replicas(args, out_dir)
    if args.mode == "memory":
        from pagedllm.core.config import PLACEMENTS

        from .kv_memory import kv_capacity, measure_kv_utilisation, print_capacity, print_placements

        rows = [measure_kv_utilisation(num_requests=args.num_prompts, seed=args.seed, placement=p) for p in PLACEMENTS]
        r = next(row for row in rows if row["placement"] == "lru")
        print(
            f"{r['requests']} requests, {r['steps']} steps: live share of allocated KV slots — paged "
            f"{r['paged']:.1%}, contiguous max_model_len {r['contiguous_max_model_len']:.1%}, "
            f"contiguous exact length {r['contiguous_exact_length']:.1%}"
        )
        print_placements(rows)
        memory = parse_size(args.kv_cache_memory, "kv_cache_memory")
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        capacity = kv_capacity(model_dir_of(args), dtype, memory)
        print_capacity(capacity, memory, dtype)
        without_series = lambda row: {k: v for k, v in row.items() if k != "series"}
        _write_json(
            args,
            os.path.join(out_dir, "memory.json"),
            {**without_series(r), "placements": [without_series(x) for x in rows], "kv_capacity": capacity},
        )
        report.plot_kv_usage(os.path.join(out_dir, "kv_usage.png"), r["series"], r["block_size"])
        return 0
    return _throughput(args, out_dir, peers)


# peers run in their own environment: (flag, argument, what that environment must have)
PEER_INTERPRETERS = {
    "vllm": ("--vllm-python", "vllm_python", "vLLM"),
    "llama.cpp": ("--llama-cpp-python", "llama_cpp_python", "llama-cpp-python and gguf"),
}


def _throughput_peers(args) -> list[str]:
    """The peers --vs and the interpreter flags ask for; a wrong flag is answered here, before
    anything is imported or measured."""
    from .workload import PEERS

    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    peers = [p for p in args.vs.split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"--vs: unknown peer(s) {sorted(unknown)}; available: {', '.join(PEERS)}")
    for peer, (flag, attr, needs) in PEER_INTERPRETERS.items():
        python = getattr(args, attr)
        if python and peer not in peers:
            peers.append(peer)
        if peer in peers and not python:
            raise ValueError(f"--vs {peer} needs {flag}: the interpreter of an environment with {needs} installed")
        if python and not os.access(python, os.X_OK):
            raise ValueError(f"{flag}: {python} is not an executable")
    return peers


def _throughput(args, out_dir: str, peers: list[str]) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from . import report
    from .bench_throughput import compare

    model_dir = model_dir_of(args)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = None
    if args.dataset not in ("synthetic", "uniform"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, max_tokens = load_dataset(
        args.dataset, args.num_prompts, args.seed, tokenizer, hf.config.vocab_size, hf.config.max_position_embeddings
    )
    print(
        f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(max_tokens)} output tokens "
        f"requested; model {model_dir}; dtype {args.dtype}"
    )
    run = compare(
        hf,
        model_dir,
        prompts,
        max_tokens,
        peers,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        backend=args.backend,
        batch_size=args.batch_size,
        vllm_python=args.vllm_python,
        llama_cpp_python=args.llama_cpp_python,
        peer_work=out_dir,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtypes=args.kv_cache_dtype.split(","),
        rounds=args.rounds or 1,
        busy=args.busy,
    )
    results = run["results"]
    bandwidth = {}
    if len(prompts) == 1:  # one request: decode reads every weight a token
        with open(os.path.join(model_dir, "config.json")) as f:
            per_token = report.weight_bytes_per_token(json.load(f), args.dtype, args.quantization)
        probe = max(v for k, v in args.machine.items() if k.startswith("memory_gb_s"))
        print("\n".join(report.bandwidth_lines(results, per_token, probe)))
        bandwidth = {"weight_bytes_per_token": per_token, "probe_gb_s": probe}
    _write_json(
        args,
        os.path.join(out_dir, "throughput.json"),
        {
            "date": time.strftime("%Y-%m-%d"),
            "model": model_dir,
            "dtype": args.dtype,
            "dataset": args.dataset,
            "requests": len(prompts),
            "rounds": run["rounds"],
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "peer_versions": run["peer_versions"],
            **bandwidth,
            "results": [{**r.__dict__, "output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s} for r in results],
        },
    )
    report.plot_throughput(
        os.path.join(out_dir, "throughput.png"),
        results,
        f"{len(prompts)} requests, {args.dtype}, {os.path.basename(model_dir.rstrip('/'))}",
    )
    print(f"wrote {out_dir}/throughput.json and throughput.png")
    return 0


def _latency(args, out_dir: str) -> int:
    """Requests arrive as a Poisson process at each rate; time to first token and the gaps
    between tokens are measured where the caller receives them."""
    from . import report
    from .bench_latency import measure, print_rows

    model_dir, prompts, max_tokens = _token_workload(args)
    rates = [float(r) for r in args.rates.split(",")]
    rows = measure(
        model_dir,
        prompts,
        max_tokens,
        rates,
        args.seed,
        backend=args.backend,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
    )
    print_rows(rows)
    _write_json(
        args, os.path.join(out_dir, "latency.json"), {"model": model_dir, "requests": len(prompts), "rows": rows}
    )
    report.plot_latency(os.path.join(out_dir, "latency.png"), rows)
    return 0


def _serving(args, out_dir: str) -> int:
    """The workload against a running `pagedllm serve` at each request rate, and offline."""
    from . import report
    from .bench_serving import print_report, serving_benchmark

    model_dir, prompts, max_tokens = _token_workload(args)
    rates = [float(r) for r in args.rates.split(",")]
    if float("inf") not in rates:
        rates.append(float("inf"))  # saturation, for the served / offline ratio
    result = serving_benchmark(
        model_dir,
        prompts,
        max_tokens,
        rates,
        args.backend,
        args.dtype,
        args.kv_cache_memory,
        args.seed,
        rounds=args.rounds or 2,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
    )
    print_report(result)
    finite = lambda r: {**r, "rate": "inf" if r["rate"] == float("inf") else r["rate"]}
    _write_json(
        args,
        os.path.join(out_dir, "serving.json"),
        {
            "model": model_dir,
            "requests": len(prompts),
            **result,
            "rows": [finite(r) for r in result["rows"]],
            "served_saturated": finite(result["served_saturated"]),
        },
    )
    report.plot_latency(
        os.path.join(out_dir, "serving_latency.png"), [r for r in result["rows"] if r["rate"] != float("inf")]
    )
    print(f"wrote {out_dir}/serving.json and serving_latency.png")
    return 0


def _replicas(args, out_dir: str) -> int:
    """Multi-turn chats against engine replicas on Ray Serve: 1, 2 prefix-aware, 2 round robin."""
    from .bench_replicas import print_header, replicas_benchmark

    engine_args = {
        "model": model_dir_of(args),
        "backend": args.backend,
        "dtype": args.dtype,
        "kv_cache_memory": args.kv_cache_memory,
        "tensor_parallel_size": args.tensor_parallel_size,
        "quantization": args.quantization,
        "seed": args.seed,
    }
    print_header()
    rows = replicas_benchmark(engine_args, conversations=args.num_prompts, seed=args.seed)
    _write_json(args, os.path.join(out_dir, "replicas.json"), {"engine_args": engine_args, "rows": rows})
    print(f"wrote {out_dir}/replicas.json")
    return 0


def _scaling(args, out_dir: str) -> int:
    """Throughput of the same workload as the number of concurrently running requests
    (max_num_seqs) grows."""
    from pagedllm import LLM, SamplingParams

    from . import report

    model_dir, prompts, max_tokens = _token_workload(args)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        with LLM(
            model_dir,
            backend=args.backend,
            dtype=args.dtype,
            skip_tokenizer_init=True,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=concurrency,
            tensor_parallel_size=args.tensor_parallel_size,
            quantization=args.quantization,
        ) as llm:
            start = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.monotonic() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"concurrency": concurrency, "output_tok_s": tokens / seconds, "seconds": seconds})
        print(f"max_num_seqs {concurrency:4d}: {tokens / seconds:8.0f} output tok/s", flush=True)
    _write_json(
        args, os.path.join(out_dir, "scaling.json"), {"model": model_dir, "requests": len(prompts), "rows": rows}
    )
    report.plot_scaling(os.path.join(out_dir, "scaling.png"), rows)
    return 0


def add_parser(sub) -> None:
    from pagedllm.entrypoints.engine_args import EngineArgs

    bench = sub.add_parser("bench", help="benchmark pagedllm against transformers on one workload")
    bench.add_argument("mode", choices=["throughput", "latency", "serving", "scaling", "memory", "replicas"])
    bench.add_argument(
        "--model",
        default=None,
        help="model folder (default: the demo model), or random:layers=2,hidden=192[,intermediate=,heads=,"
        "kv_heads=,vocab=]: a seeded random-weight Llama written under --out",
    )
    # the engine's own flags (EngineArgs' declarations); the benchmarks' defaults: float32, the
    # dtype the transformers peers compute in, and a pool that holds a whole workload
    EngineArgs.add_cli_args(
        bench,
        only=("backend", "dtype", "tensor_parallel_size", "quantization", "kv_cache_memory", "seed"),
        defaults={"dtype": "float32", "kv_cache_memory": "2GiB"},
    )
    bench.add_argument("--num-prompts", type=int, default=200)
    bench.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (seeded, long-tailed), uniform (16-256 tokens each way) or a JSONL file of "
        "{prompt|prompt_token_ids, output_len}",
    )
    bench.add_argument(
        "--vs",
        default="hf-static,hf-cb",
        help="comma-separated peers: hf-static, hf-cb, vllm (needs --vllm-python), llama.cpp (needs "
        "--llama-cpp-python), or none",
    )
    bench.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vLLM installed; vLLM then joins the throughput table",
    )
    bench.add_argument(
        "--llama-cpp-python",
        default=None,
        help="python of an environment with llama-cpp-python and gguf installed; llama.cpp then joins the table",
    )
    bench.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    bench.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="throughput: pagedllm's KV cache dtype; several (auto,int8) run one after the other, each a row",
    )
    bench.add_argument(
        "--rates",
        default="1,2,4,8",
        help="latency and serving: request rates (req/s) to sweep; serving adds inf (all at once)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="throughput: the workload this many times, every system in turn each round, the median "
        "counting (default 1); serving: alternating offline and saturated served runs, the best counting "
        "(default 2)",
    )
    bench.add_argument("--concurrency", default="1,4,16,64,256", help="scaling: max_num_seqs values to sweep")
    bench.add_argument(
        "--busy",
        type=int,
        default=0,
        help="run this many busy processes (python -c 'while True: pass') beside the benchmark: a shared machine",
    )
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(func=cmd_bench)
