"""Prometheus metrics of a serving engine, named like vLLM's (`vllm:` becomes `pagedllm:`; the
gauges routers read are also under vLLM's own names) and labelled with the served model's
name. Engine-wide figures come from the stats on every
engine message; per-request figures from each request's timing when it ends."""

from __future__ import annotations

from operator import attrgetter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.core.protocol import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
# the engine's counts are cumulative since start; each counter takes the increment
_CUMULATIVE = (
    ("prefix_queries", "scheduler.prefix_cache_queries"),
    ("prefix_hits", "scheduler.prefix_cache_hits"),
    ("preemptions", "scheduler.num_preemptions"),
    ("worker_restarts", "worker_restarts"),
    ("steps", "steps"),
    ("planned_ahead", "planned_ahead"),
    ("steps_in_runs", "steps_in_runs"),
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        label = {"model_name": model_name}

        def metric(kind, name, doc, **kw):
            return kind(f"pagedllm:{name}", doc, list(label), registry=self.registry, **kw).labels(**label)

        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = metric(Gauge, "num_requests_swapped", "Requests whose KV cache is swapped out.")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).")
        self.kv_internal_waste = metric(
            Gauge, "kv_internal_waste_perc", "Share of the slots in live block tables holding no token."
        )
        self.kv_external_fragmentation = metric(
            Gauge,
            "kv_external_fragmentation_perc",
            "Share of free KV blocks in runs of consecutive ids shorter than a median block table.",
        )
        self.kv_table_run = metric(
            Gauge, "kv_table_mean_run_blocks", "Blocks per run of consecutive ids in live block tables, on average."
        )
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = metric(Counter, "num_preemptions", "Preemptions of running requests.")
        self.worker_restarts = metric(Counter, "worker_restarts", "Workers replaced after they died.")
        self.steps = metric(Counter, "engine_steps", "Steps the workers computed.")
        self.planned_ahead = metric(
            Counter, "steps_planned_ahead", "Steps planned while the previous one computed (async scheduling)."
        )
        self.steps_in_runs = metric(
            Counter, "steps_in_decode_runs", "Steps of decode runs past their first: the workers ran them unplanned."
        )
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens.")
        self.batch_size = metric(Histogram, "batch_size", "Requests in each step's batch.", buckets=_BATCH_BUCKETS)
        self.iteration_tokens = metric(
            Histogram, "iteration_tokens_total", "Tokens computed in each step.", buckets=_TOKEN_BUCKETS
        )
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS)
        self.itl = metric(
            Histogram, "inter_token_latency_seconds", "Time between successive tokens.", buckets=_LATENCY_BUCKETS
        )
        self.e2e = metric(
            Histogram, "e2e_request_latency_seconds", "Request latency, arrival to end.", buckets=_REQUEST_BUCKETS
        )
        self.queue_time = metric(
            Histogram,
            "request_queue_time_seconds",
            "Time from arrival to first being scheduled.",
            buckets=_REQUEST_BUCKETS,
        )
        self._success = Counter(
            "pagedllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # the gauges routers and the Gateway API inference extension read, under vLLM's own names
        self._vllm_gauges = {
            attr: Gauge(f"vllm:{name}", doc, list(label), registry=self.registry).labels(**label)
            for attr, name, doc in (
                ("num_running", "num_requests_running", "Requests in the running batch (vLLM's name)."),
                ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled (vLLM's name)."),
                ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (vLLM's name)."),
            )
        }
        self._last: EngineStats | None = None
        self._spec = {
            name: metric(Counter, f"spec_decode_{name}", doc)
            for name, doc in (
                ("num_drafts", "Speculative proposals verified."),
                ("num_draft_tokens", "Tokens proposed by the speculative proposer."),
                ("num_accepted_tokens", "Proposed tokens the model confirmed."),
            )
        }
        self._spec_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposals whose token at this position was confirmed.",
            ["model_name", "position"],
            registry=self.registry,
        )

    def observe_cache_config(self, ready, kv_cache_dtype: str) -> None:
        """The KV pool the engine started with, as vLLM's cache_config_info: a gauge of 1 whose
        labels say it (ready: core.protocol.EngineReady)."""
        info = Gauge(
            "pagedllm:cache_config_info",
            "The KV cache's configuration (labels).",
            ["model_name", "block_size", "cache_dtype", "num_gpu_blocks", "num_swap_blocks"],
            registry=self.registry,
        )
        labels = (ready.block_size, kv_cache_dtype, ready.num_blocks, ready.num_swap_blocks)
        info.labels(self.model_name, *map(str, labels)).set(1)

    def observe_stats(self, stats: EngineStats) -> None:
        sched = stats.scheduler
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.swapped.set(sched.num_swapped)
        self.kv_usage.set(sched.kv_cache_usage)
        for attr, gauge in self._vllm_gauges.items():
            gauge.set(getattr(sched, attr))
        if sched.fragmentation is not None:
            self.kv_internal_waste.set(sched.fragmentation.internal_waste)
            self.kv_external_fragmentation.set(sched.fragmentation.external)
            self.kv_table_run.set(sched.fragmentation.mean_table_run)
        last = self._last
        for name, field in _CUMULATIVE:
            count = attrgetter(field)
            getattr(self, name).inc(count(stats) - (count(last) if last else 0))
        if sched.spec_decode is not None:
            self._observe_spec(sched.spec_decode, last.scheduler.spec_decode if last else None)
        self._last = stats
        for size, tokens in zip(stats.batch_sizes, stats.batch_tokens):
            self.batch_size.observe(size)
            self.iteration_tokens.observe(tokens)

    def _observe_spec(self, now, before) -> None:
        for name, counter in self._spec.items():
            counter.inc(getattr(now, name) - (getattr(before, name) if before else 0))
        for pos, count in enumerate(now.num_accepted_tokens_per_pos):
            done = before.num_accepted_tokens_per_pos[pos] if before else 0
            self._spec_per_pos.labels(self.model_name, str(pos)).inc(count - done)

    def observe_request(self, timing, output) -> None:
        """timing: request_tracker.RequestTiming; output: the RequestOutput as it ended."""
        generated = sum(len(c.token_ids) for c in output.outputs)
        if timing.first_token is not None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.ttft.observe(timing.first_token - timing.submitted)
            self.e2e.observe(timing.last_token - timing.submitted)
        self.generation_tokens.inc(generated)
        for gap in timing.token_gaps:
            self.itl.observe(gap)
        if timing.queued_seconds is not None:
            self.queue_time.observe(timing.queued_seconds)
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"  # unfinished: the client went away
            self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
