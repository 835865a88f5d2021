"""Serving benchmark: the synthetic workload sent to a running `pagedllm serve` over the OpenAI
HTTP API (streaming, read by a bare asyncio HTTP client), as a Poisson process at each request rate and
all at once ("inf", saturation); TTFT and inter-token latency p50/p99 and throughput per rate;
then the same workload offline through `LLM.generate` in the same run, and the ratio.

    pagedllm bench serving [--num-prompts 100] [--rates 2,8] [--dtype bfloat16]   (the front door: benchmarks/cli.py)

Goal: served throughput at saturation >= 90% of offline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time

from pagedllm.benchmarks.report import percentiles_ms
from pagedllm.benchmarks.workload import poisson_arrivals
from pagedllm.core.process.ipc import free_tcp_port


def start_server(
    model_dir: str,
    backend: str,
    dtype: str,
    kv_cache_memory: str,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
) -> tuple[subprocess.Popen, str]:
    port = free_tcp_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "serve",
            "--model",
            model_dir,
            "--backend",
            backend,
            "--dtype",
            dtype,
            "--kv-cache-memory",
            kv_cache_memory,
            "--port",
            str(port),
            "--zmq-endpoint",
            "none",
            "--max-queue-len",
            "100000",
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            *(["--quantization", quantization] if quantization else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    banner = proc.stdout.readline()
    if "serving" not in banner:
        proc.kill()
        raise RuntimeError(f"the server did not start: {banner}{proc.stdout.read()}")
    return proc, f"http://127.0.0.1:{port}/v1"


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def sse_events(host: str, port: int, path: str, payload: dict):
    """POST a JSON body and yield the server-sent events' data as they arrive. A bare HTTP/1.1
    client on asyncio streams: on a 2-core machine the openai client's per-chunk parsing would
    take CPU from the engine and be counted as server overhead."""
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(payload).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
    )
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{path}: {status.decode().strip()} {await reader.read()!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    buffered = b""
    try:
        while True:  # chunked transfer encoding
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            buffered += (await reader.readexactly(size + 2))[:-2]
            *events, buffered = buffered.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    yield event[6:]
    finally:
        writer.close()


async def _one(host: str, port: int, model: str, ids: list[int], max_tokens: int, delay: float, record: list) -> None:
    await asyncio.sleep(delay)
    sent = time.monotonic()
    times, tokens = [], 0
    payload = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    async for data in sse_events(host, port, "/v1/completions", payload):
        if b'"usage":{' in data:
            tokens = json.loads(data)["usage"]["completion_tokens"]
        else:
            times.append(time.monotonic())
    record.append((sent, times, tokens))


def run_rate(base_url: str, model: str, prompts, max_tokens, rate: float, seed: int) -> dict:
    """One sweep point: requests arrive as a Poisson process at `rate` per second (inf: all at once)."""
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    delays = poisson_arrivals(len(prompts), rate, seed)
    record: list = []

    async def main():
        await asyncio.gather(
            *(_one(host, int(port), model, p, m, d, record) for p, m, d in zip(prompts, max_tokens, delays))
        )

    start = time.monotonic()
    asyncio.run(main())
    seconds = time.monotonic() - start
    ttft = [times[0] - sent for sent, times, _ in record if times]
    itl = [b - a for _, times, _ in record for a, b in itertools.pairwise(times)]
    tokens = sum(n for _, _, n in record)
    return {
        "rate": rate,
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "ttft_ms": percentiles_ms(ttft),
        "itl_ms": percentiles_ms(itl),
    }


def run_offline(
    model_dir: str,
    prompts,
    max_tokens,
    backend: str,
    dtype: str,
    kv_cache_memory: str,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
) -> dict:
    from pagedllm import LLM, SamplingParams

    # with the tokenizer: the server detokenizes every token it streams, so this does too
    with LLM(
        model_dir,
        backend=backend,
        dtype=dtype,
        kv_cache_memory=kv_cache_memory,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
    ) as llm:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        start = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}


def serving_benchmark(
    model_dir: str,
    prompts,
    max_tokens,
    rates: list[float],
    backend: str = "cpu",
    dtype: str = "float32",
    kv_cache_memory: str = "2GiB",
    seed: int = 0,
    rounds: int = 2,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
) -> dict:
    """The rate sweep, then `rounds` alternating offline and saturated served runs (the best
    of each): this machine's run-to-run noise is larger than the difference being measured."""
    proc, base_url = start_server(model_dir, backend, dtype, kv_cache_memory, tensor_parallel_size, quantization)
    try:
        rows = [run_rate(base_url, model_dir, prompts, max_tokens, rate, seed) for rate in rates]
        offline, served = [], [r for r in rows if r["rate"] == float("inf")]
        for _ in range(rounds):
            offline.append(
                run_offline(
                    model_dir, prompts, max_tokens, backend, dtype, kv_cache_memory, tensor_parallel_size, quantization
                )
            )
            served.append(run_rate(base_url, model_dir, prompts, max_tokens, float("inf"), seed))
    finally:
        stop_server(proc)
    best_offline = max(offline, key=lambda r: r["output_tok_s"])
    best_served = max(served, key=lambda r: r["output_tok_s"])
    return {
        "offline": best_offline,
        "served_saturated": best_served,
        "rows": rows,
        "offline_runs": [r["output_tok_s"] for r in offline],
        "served_saturated_runs": [r["output_tok_s"] for r in served],
        "served_over_offline": best_served["output_tok_s"] / best_offline["output_tok_s"],
    }


def print_report(result: dict) -> None:
    head = f"{'req/s':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'out tok/s':>10}"
    print(head + "\n" + "-" * len(head))
    for r in result["rows"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"{r['rate']:7.1f} {t['p50']:9.1f} {t['p99']:8.1f} {i['p50']:8.1f} {i['p99']:8.1f} "
            f"{r['output_tok_s']:10.0f}"
        )
    print(f"{'offline':>7} {'':>9} {'':>8} {'':>8} {'':>8} {result['offline']['output_tok_s']:10.0f}")
    runs = lambda key: ", ".join(f"{v:.0f}" for v in result[key])
    print(
        f"(milliseconds) saturated runs: served {runs('served_saturated_runs')} tok/s, offline "
        f"{runs('offline_runs')} tok/s; best served / best offline: {result['served_over_offline']:.2f} "
        f"(goal >= 0.90)"
    )
