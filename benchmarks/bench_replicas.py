"""Replicas benchmark: multi-turn chats, every turn the history so far, against engine replicas on
Ray Serve in one run: 1 replica, 2 behind the prefix-aware router, 2 round robin (each started
fresh, so every cache starts empty). Per setting: output throughput, TTFT p50/p99 (streamed),
the share of follow-up turns that found their prefix cached, and the requests that failed.

    pagedllm bench replicas [--num-prompts 16 (conversations)] [--model DIR]   (benchmarks/cli.py)

On a 2-core machine two replicas share the cores one had: expect no speed-up there; the
figures that matter are the prefix hits and that nothing is lost."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from pagedllm.benchmarks.bench_serving import sse_events
from pagedllm.benchmarks.report import percentiles_ms
from pagedllm.core.process.ipc import free_tcp_port

SETTINGS = (("1 replica", 1, "prefix"), ("2, prefix-aware", 2, "prefix"), ("2, round robin", 2, "round_robin"))
TURNS = 4
MAX_TOKENS = 32
WORDS = ["engine", "block", "cache", "token", "batch", "request", "replica", "router", "prefix", "stream", "model"]


def first_messages(num: int, seed: int) -> list[str]:
    """Each conversation's own opening message (a few hundred characters: several KV blocks)."""
    rng = random.Random(seed)
    return [f"Conversation {i}: " + " ".join(rng.choice(WORDS) for _ in range(60)) for i in range(num)]


async def _conversation(port: int, model: str, first: str, record: list, failures: list) -> None:
    messages = [{"role": "user", "content": first}]
    for turn in range(TURNS):
        payload = {
            "model": model,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, first_token, text, usage = time.monotonic(), None, "", None
        try:
            async for data in sse_events("127.0.0.1", port, "/v1/chat/completions", payload):
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        first_token = first_token or time.monotonic()
                        text += choice["delta"]["content"]
        except (OSError, RuntimeError) as e:
            failures.append(str(e))
            return
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record.append(
            {
                "turn": turn,
                "ttft": (first_token or time.monotonic()) - sent,
                "tokens": usage["completion_tokens"],
                "cached": cached,
            }
        )
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then ({turn})?"}]


def run_setting(port: int, model: str, firsts: list[str]) -> dict:
    record, failures = [], []

    async def main():
        await asyncio.gather(*(_conversation(port, model, f, record, failures) for f in firsts))

    start = time.monotonic()
    asyncio.run(main())
    seconds = time.monotonic() - start
    follow_ups = [r for r in record if r["turn"] > 0]
    tokens = sum(r["tokens"] for r in record)
    return {
        "requests": len(record),
        "failed": len(failures),
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "ttft_ms": percentiles_ms([r["ttft"] for r in record]),
        "follow_up_hit_rate": sum(r["cached"] > 0 for r in follow_ups) / max(1, len(follow_ups)),
        "cached_prompt_tokens": sum(r["cached"] for r in record),
    }


def replicas_benchmark(engine_args: dict, conversations: int = 16, seed: int = 0) -> list[dict]:
    import ray
    from ray import serve

    from pagedllm.entrypoints.ray_serve import build_app
    from pagedllm.entrypoints.serve import ServeOptions

    port = free_tcp_port()
    firsts = first_messages(conversations, seed)
    quiet = {"log_level": "WARNING"}
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
        for name, replicas, routing in SETTINGS:
            options = ServeOptions(model_name="bench", max_queue_len=100_000)
            app = build_app(engine_args, num_replicas=replicas, options=options, routing=routing)
            serve.run(app, name="bench", route_prefix="/", logging_config=quiet)
            rows.append(
                {"setting": name, "replicas": replicas, "routing": routing, **run_setting(port, "bench", firsts)}
            )
            print_row(rows[-1])
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def print_header() -> None:
    head = f"{'setting':<17} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>8} {'follow-up hits':>15} {'failed':>7}"
    print(head + "\n" + "-" * len(head), flush=True)


def print_row(r: dict) -> None:
    t = r["ttft_ms"]
    print(
        f"{r['setting']:<17} {r['output_tok_s']:9.0f} {t['p50']:9.1f} {t['p99']:8.1f} "
        f"{r['follow_up_hit_rate']:15.0%} {r['failed']:7d}",
        flush=True,
    )
