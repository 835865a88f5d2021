"""The engine-core process: one loop that takes requests and aborts, schedules a step, has the
workers run it, applies the sampled tokens and streams outputs back. Never imports torch.

While the workers compute step k+1, the core sends step k's outputs to the frontend and takes
new messages, so its own work overlaps the forward pass. A worker that dies is replaced (see
`_recover`): the KV pool in shared memory outlives it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import zmq

from ..config import CacheConfig, EngineConfig, SchedulerConfig, default_batched_tokens
from ..errors import EngineFailure, InvalidParameter
from ..kv_events import ZmqEventPublisher, batch_of
from ..outputs import SchedulerOutput, merge_deltas
from ..protocol import (
    AbortRequests,
    AddRequests,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRecovered,
    EngineRecovering,
    EngineStats,
    FrontendMessage,
    InitCache,
    RequestOutputDelta,
    RequestRejected,
    ResetPrefixCache,
    Shutdown,
    Step,
    StepMasks,
    StepResult,
    WorkerHello,
    WorkerReady,
)
from ..request import is_sample_of, sample_request_ids
from ..scheduling.scheduler import Scheduler
from ..scheduling.structured import StructuredOutputs
from . import shm
from .ipc import Channel, PeerGone, remove_ipc_dir
from .local_workers import LocalWorkers
from .recovery import RESTART_WINDOW_S, RestartBudget
from .worker_group import WorkerFailure, WorkerGroup

logger = logging.getLogger("pagedllm.core")

POLL_MS = 100  # how often a blocked loop checks that its peers are alive
WORKER_START_TIMEOUT_S = 300
FRONTEND_GONE_MS = 5000  # a send to the frontend that finds no peer this long: it is gone
COMPILE_POLL_MS = 2  # how often an otherwise idle loop looks whether a grammar has compiled
# a decode run (SchedulerOutput.num_steps) the engine sizes takes about this long at most: a
# request that arrives meanwhile waits for it to end
DECODE_RUN_SECONDS = 0.004
DECODE_RUN_MOST = 8  # steps, where num_scheduler_steps is left to the engine


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        input_endpoint: str,
        output_endpoint: str,
        worker_endpoint: str,
        launcher: LocalWorkers | None = None,
    ):
        self.config = config
        self.launcher = launcher  # started early by engine_main, so its torch import overlaps ours
        self.input_endpoint = input_endpoint
        self.parent_pid = os.getppid()
        self.ctx = zmq.Context()
        self.from_frontend = Channel(self.ctx, zmq.PULL, input_endpoint, bind=True, message_type=FrontendMessage)
        self.to_frontend = Channel(self.ctx, zmq.PUSH, output_endpoint, bind=True)
        self.worker_endpoint = config.worker_endpoint or worker_endpoint
        self.workers: WorkerGroup | None = None
        self.segments: list[str] = []
        self.scheduler: Scheduler | None = None
        self.pending: list[RequestOutputDelta] = []
        # final_only requests (and their n > 1 samples): what they have produced, sent when they end
        self.final_only: set[str] = set()
        self.held: dict[str, RequestOutputDelta] = {}
        self.steps = 0
        self.planned_ahead = 0
        self.steps_in_runs = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self._last_forward_seconds = 0.0  # the last step's, in the worker (decode runs' length)
        self._step_mark = 0.0  # when the step now being waited on began to count
        self._batch_sizes: list[int] = []
        self._batch_tokens: list[int] = []
        self.stopping = False
        self._empty_plans = 0  # plans in a row that had nothing for the workers
        # sent and not yet applied, oldest first: one, or two under async scheduling (the second
        # planned ahead: its masks, where it has any, go out once the first's tokens are applied)
        self.in_flight: deque[SchedulerOutput] = deque()
        self._inits: list[InitCache] = []  # per rank, sent again to a replacement worker
        self.restarts = RestartBudget(config.max_worker_restarts, RESTART_WINDOW_S)
        self.recovered_tokens = 0  # computed tokens that recoveries kept (the pool outlived the worker)
        # structured outputs: grammars compile on a thread, off this loop; a request waits there
        # until its matcher is ready
        self.structured = StructuredOutputs(config.jump_forward, config.model)
        self.kv_events: ZmqEventPublisher | None = None  # --kv-events-config

    # --- start-up -------------------------------------------------------------------------
    def start(self) -> None:
        shm.remove_stale_segments()
        self.workers = WorkerGroup(self.ctx, self.worker_endpoint, self.config, self.launcher)
        self.workers.start()
        hellos = self.workers.gather(WorkerHello, WORKER_START_TIMEOUT_S, self._check_frontend)
        cache_config, sched_config = self._size_cache(hellos)
        self.scheduler = Scheduler(sched_config, cache_config, self.structured)  # checks that max_model_len fits
        events = self.config.kv_events_config
        if events is not None and events.publishing:
            self.kv_events = ZmqEventPublisher(events)
            self.scheduler.kv.pool.events = []
        kv_segments = [self._init_cache(rank, hello, cache_config, sched_config) for rank, hello in enumerate(hellos)]
        self.workers.gather(WorkerReady, WORKER_START_TIMEOUT_S, self._check_frontend)
        self._to_frontend(
            EngineReady(
                num_blocks=cache_config.num_blocks,
                num_swap_blocks=cache_config.num_swap_blocks,
                block_size=cache_config.block_size,
                max_model_len=sched_config.max_model_len,
                backend=self.config.backend,
                kv_segments=kv_segments,
                launcher_pid=self.workers.launcher_pid(),
                batch_invariant=all(h.batch_invariant for h in hellos),
            )
        )

    def _init_cache(self, rank: int, hello: WorkerHello, cache: CacheConfig, sched: SchedulerConfig) -> str | None:
        """Rank `rank`'s pools — shared-memory segments of its own KV heads when it runs on this
        host and its backend keeps them in host memory — and its InitCache."""
        local = self.workers.is_local(rank)
        kv = (
            self._create_segment(f"kv-r{rank}", cache.num_blocks * hello.kv_spec.pool_bytes_per_slot * cache.block_size)
            if local and hello.kv_in_shared_memory
            else None
        )
        swap = (
            self._create_segment(
                f"swap-r{rank}", cache.num_swap_blocks * hello.kv_spec.bytes_per_block_slot * cache.block_size
            )
            if local and cache.num_swap_blocks
            else None
        )
        init = InitCache(
            num_blocks=cache.num_blocks,
            num_swap_blocks=cache.num_swap_blocks,
            block_size=cache.block_size,
            kv_segment=kv,
            swap_segment=swap,
            max_model_len=sched.max_model_len,
        )
        self._inits.append(init)
        self.workers.send(rank, init)
        return kv

    def _size_cache(self, hellos: list[WorkerHello]) -> tuple[CacheConfig, SchedulerConfig]:
        """The KV pool from the configured memory (or the worker's profile on a GPU), and the
        context length: the model's own, no longer than what the pool holds."""
        cfg, hello = self.config, hellos[0]  # every rank has the same model; pools of its own heads
        max_model_len = cfg.max_model_len or hello.max_position_embeddings
        block_bytes = hello.kv_spec.pool_bytes_per_slot * cfg.block_size
        if cfg.num_kv_blocks:
            num_blocks = cfg.num_kv_blocks
        elif hello.num_device_blocks is not None:
            num_blocks = min(h.num_device_blocks for h in hellos)  # block ids are the same on every rank
        else:
            num_blocks = cfg.kv_cache_memory // block_bytes
        num_blocks = max(num_blocks, 2)
        if cfg.max_model_len is None and not hello.sliding_window:
            max_model_len = min(max_model_len, (num_blocks - 1) * cfg.block_size)
        cache = CacheConfig.of(
            cfg,
            num_blocks=num_blocks,
            num_swap_blocks=cfg.swap_space // (hello.kv_spec.bytes_per_block_slot * cfg.block_size),
            sliding_window=hello.sliding_window,
        )
        sched = SchedulerConfig.of(
            cfg,
            max_num_batched_tokens=cfg.max_num_batched_tokens or default_batched_tokens(max_model_len),
            max_model_len=max_model_len,
        )
        return cache, sched

    def _create_segment(self, role: str, size: int) -> str:
        name = shm.segment_name(role)
        shm.create_segment(name, size)
        self.segments.append(name)
        return name

    # --- recovery -------------------------------------------------------------------------
    def _recover(self, failure: WorkerFailure) -> None:
        """Replace the workers and go on: the same KV segments, every running request resent in
        full, the step that failed planned again. Where the pool is not in shared memory the
        running requests are recomputed. Past the restart budget, or when a replacement reports
        an error while starting (it would meet it again), the engine is dead."""
        self._to_frontend(EngineRecovering(str(failure)))
        started = time.monotonic()
        while True:
            if self.config.nnodes > 1:
                raise EngineFailure(f"{failure} (ranks on other hosts are not restarted)")
            if not self.restarts.take():
                raise EngineFailure(f"{failure}; {self.restarts.describe()}")
            logger.warning("%s; restarting the workers (%s)", failure, self.restarts.describe())
            try:
                self._start_replacements()
                break
            except WorkerFailure as e:
                if e.reported:
                    raise EngineFailure(f"a replacement worker failed while starting: {e}") from None
                failure = e  # killed while starting: that is one more restart
        kv_lost = any(init.kv_segment is None for init in self._inits)
        failed = list(self.in_flight)
        self.in_flight.clear()
        kept = self.scheduler.recover(failed, kv_lost)
        self.recovered_tokens += kept
        logger.warning(
            "workers replaced in %.1f s; %d computed tokens kept%s",
            time.monotonic() - started,
            kept,
            " (the KV pool was lost: running requests recompute)" if kv_lost else "",
        )
        self._to_frontend(EngineRecovered(self.config.tensor_parallel_size))

    def _start_replacements(self) -> None:
        self.workers.restart()
        self.workers.gather(WorkerHello, WORKER_START_TIMEOUT_S, self._check_frontend)
        for rank, init in enumerate(self._inits):
            self.workers.send(rank, init)
        self.workers.gather(WorkerReady, WORKER_START_TIMEOUT_S, self._check_frontend)

    def _check_frontend(self) -> None:
        if os.getppid() != self.parent_pid:
            self.stopping = True
            raise EngineFailure("frontend process is gone")

    def _check_peers(self) -> None:
        self.workers.check_alive()
        self._check_frontend()

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            try:
                self._run_steps()
            except WorkerFailure as failure:
                self._recover(failure)

    def _run_steps(self) -> None:
        sched = self.scheduler
        in_flight = self.in_flight
        while not self.stopping:
            if not in_flight:
                if self.structured.compiling:
                    self._admit_compiled()
                busy = sched.has_unfinished_requests()
                if busy and self._empty_plans < 2:
                    wait_ms = 0
                else:  # idle, or a second empty plan in a row: nothing runs until a message (or a grammar) comes
                    wait_ms = COMPILE_POLL_MS if self.structured.compiling else POLL_MS
                self._take_frontend_messages(wait_ms)
                if busy and wait_ms:  # nothing could be planned: do not outlive a frontend that is gone
                    self._check_peers()
                if not busy:
                    self._flush_outputs()  # e.g. aborts that emptied the engine, with fresh stats
                    self._check_peers()
                    self.workers.keep_alive()
                    continue
                if self.stopping:
                    break
                self._send_step()
                if not in_flight:
                    continue
            if self.config.async_scheduling and len(in_flight) == 1 and in_flight[0].num_steps == 1:
                self._send_step_ahead()  # the workers find it queued when they finish this one
            # the workers compute; meanwhile flush outputs and take new messages
            self._flush_outputs()
            self._take_frontend_messages(0)
            if self.structured.compiling:
                self._admit_compiled()
            plan = in_flight[0]
            result = self._wait_result(plan)
            plan.num_steps -= 1  # a decode run's steps each answer in turn
            if not plan.num_steps:
                in_flight.popleft()
            outputs = sched.update(plan, sampled_by_request(plan, result), result.logprobs, result.spec_token_ids)
            self._report_failures()
            if in_flight and in_flight[0].structured_request_ids:  # planned ahead: its grammars now have those tokens
                self._send_masks(in_flight[0])
            self.steps += 1
            self._batch_sizes.append(len(plan.num_scheduled_tokens))
            self._batch_tokens.append(plan.total_num_scheduled_tokens)
            now = time.perf_counter()
            self.step_seconds += now - self._step_mark
            self._step_mark = now
            self.forward_seconds += result.forward_seconds
            self._last_forward_seconds = result.forward_seconds
            if not in_flight and sched.has_unfinished_requests() and not self.stopping:
                try:
                    self._send_step()
                except WorkerFailure:
                    # the worker died after answering: its step stands, and a request it ended is
                    # gone from the scheduler, so its last tokens go out now or never
                    self._collect(outputs, result)
                    self._flush_outputs()
                    raise
            self._collect(outputs, result)  # after the next step is on its way
            if not in_flight:
                self._flush_outputs()

    def _send_step(self) -> None:
        """With nothing in flight: plan a step and send it; `in_flight` holds it until its result
        is applied (a step whose workers die is planned again from it)."""
        self._step_mark = time.perf_counter()  # what came before (idle, or applying results) is not this step's
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._empty_plans += 1
            self._flush_outputs()
            self.workers.keep_alive()  # the workers hear nothing else meanwhile
            return
        self._empty_plans = 0
        self._broadcast(plan)

    def _send_step_ahead(self) -> None:
        """Async scheduling: the next step planned and sent while the one in flight computes,
        when the scheduler can plan it without that step's tokens."""
        plan = self.scheduler.schedule_ahead(self.in_flight[0], self._decode_run_length())
        if plan is not None:
            self.planned_ahead += plan.num_steps  # a decode run: each of its steps
            self.steps_in_runs += plan.num_steps - 1
            self._broadcast(plan)

    def _decode_run_length(self) -> int:
        """Steps a decode run planned now may take: num_scheduler_steps where the user set it;
        else as many as the last step's time allows within DECODE_RUN_SECONDS, at most
        DECODE_RUN_MOST."""
        if self.config.num_scheduler_steps is not None:
            return self.config.num_scheduler_steps
        if self._last_forward_seconds <= 0:
            return 1
        return max(1, min(DECODE_RUN_MOST, int(DECODE_RUN_SECONDS / self._last_forward_seconds)))

    def _broadcast(self, plan: SchedulerOutput) -> None:
        self.in_flight.append(plan)
        self.workers.broadcast(Step(plan))
        # computed while the workers run the forward pass; a step planned ahead's wait for the
        # results of the one before it (its grammars take that step's tokens first)
        if plan.structured_request_ids and len(self.in_flight) == 1:
            self._send_masks(plan)

    def _send_masks(self, plan: SchedulerOutput) -> None:
        """The plan's token masks to rank 0, which waits for them only when it samples."""
        sched = self.scheduler
        masks = self.structured.masks(plan.structured_request_ids, sched.requests, sched.fail_request)
        self._report_failures()
        self.workers.send(0, StepMasks(plan.step_id, masks))

    def _wait_result(self, plan: SchedulerOutput) -> StepResult:
        result = self.workers.wait_result(StepResult, self._check_frontend)
        if result.step_id != plan.step_id:
            raise WorkerFailure(f"worker 0 answered step {result.step_id} while step {plan.step_id} was due")
        return result

    def _collect(self, outputs: list[RequestOutputDelta], result: StepResult) -> None:
        """The scheduler's outputs, with the worker's logprobs (prompt logprobs too, also of a
        prefill chunk that sampled nothing), embeddings and the prefix-cache hit added."""
        logprobs = result.logprobs or {}
        spec_logprobs = result.spec_logprobs or {}
        prompt_logprobs = dict(result.prompt_logprobs or {})
        pooled = result.pooled or {}
        requests = self.scheduler.requests
        for out in outputs:
            out.embedding = pooled.get(out.request_id)
            lp = logprobs.get(out.request_id)
            if lp is not None and out.beams is None:
                out.logprobs = [lp]
            elif out.request_id in spec_logprobs:  # a stop inside the kept run ends the tokens early
                out.logprobs = spec_logprobs[out.request_id][: len(out.new_token_ids)]
            out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
            req = requests.get(out.request_id)
            if req is not None:
                out.num_cached_tokens = req.num_cached_tokens
        for rid, lps in prompt_logprobs.items():
            if rid in requests:
                outputs.append(RequestOutputDelta(rid, [], prompt_logprobs=lps))
        self._emit(outputs)

    def _emit(self, outputs: list[RequestOutputDelta]) -> None:
        """Outputs for the frontend; a final_only request's are held and merged until it ends."""
        held = self.held
        for out in outputs:
            rid = out.request_id
            if rid not in self.final_only:
                self.pending.append(out)
                continue
            if rid in held:
                out = merge_deltas(held.pop(rid), out)
            if out.finish_reason is None and out.beams is None:
                held[rid] = out
            else:
                self.final_only.discard(rid)
                self.pending.append(out)

    def _flush_outputs(self) -> None:
        self._publish_kv_events()
        if self.pending:
            self._to_frontend(EngineOutputs(self.pending, self._stats()))
            self.pending = []

    def _publish_kv_events(self) -> None:
        """The prefix cache's changes since the last call, as one KV event batch."""
        pool = self.scheduler.kv.pool if self.kv_events is not None else None
        if pool is not None and pool.events:
            self.kv_events.publish(batch_of(pool.events, self.scheduler.kv.block_size))
            pool.events = []

    def _stats(self) -> EngineStats:
        sizes, tokens = self._batch_sizes, self._batch_tokens
        self._batch_sizes, self._batch_tokens = [], []
        return EngineStats(
            scheduler=self.scheduler.stats(),
            steps=self.steps,
            step_seconds=self.step_seconds,
            forward_seconds=self.forward_seconds,
            batch_sizes=sizes,
            batch_tokens=tokens,
            planned_ahead=self.planned_ahead,
            steps_in_runs=self.steps_in_runs,
            worker_restarts=self.restarts.total,
            recovered_tokens=self.recovered_tokens,
        )

    def _take_frontend_messages(self, timeout_ms: int) -> None:
        sock = self.from_frontend
        if not sock.poll(timeout_ms):
            return
        while sock.poll(0):
            msg = sock.recv()
            self._empty_plans = 0
            if isinstance(msg, AddRequests):
                for request in msg.requests:
                    self._add_request(request)
            elif isinstance(msg, AbortRequests):
                self._abort_compiling(msg.request_ids)
                self._emit(self.scheduler.abort_requests(msg.request_ids))
            elif isinstance(msg, ResetPrefixCache):
                if not self.scheduler.reset_prefix_cache():
                    logger.warning("reset_prefix_cache: requests hold blocks; the prefix cache is kept")
            elif isinstance(msg, Shutdown):
                self.stopping = True
                return

    def _add_request(self, request, matcher=None) -> None:
        """Admit one request; one that cannot be taken is refused alone, with the reason. A
        constrained one first has its grammar compiled, off this loop."""
        try:
            if matcher is None and self.structured.constrained(request):
                self.structured.compile(request)
                return
            self.scheduler.add_request(request, matcher)
            if request.final_only:
                self.final_only.update(sample_request_ids(request.request_id, request.sampling_params.n))
        except InvalidParameter as e:
            self._to_frontend(RequestRejected(request.request_id, e.field, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug met by this request must not end the engine (logged)
            self.scheduler.fail_request(request.request_id, e)
            self._report_failures(also=request.request_id)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready go to the scheduler; one that did not compile is refused."""
        for request, matcher, error in self.structured.take_compiled():
            rid = request.request_id
            if isinstance(error, InvalidParameter):
                self._to_frontend(RequestRejected(rid, error.field, str(error)))
            elif error is not None:  # this request's failure is its own (logged)
                self.scheduler.fail_request(rid, error)
                self._report_failures(also=rid)
            else:
                self._add_request(request, matcher)

    def _abort_compiling(self, request_ids) -> None:
        for request in self.structured.abort(request_ids):
            ended = sample_request_ids(request.request_id, request.sampling_params.n)
            self._emit([RequestOutputDelta(eid, [], "abort") for eid in ended])

    def _report_failures(self, also: str | None = None) -> None:
        """Tell the frontend which requests the scheduler ended because handling them raised."""
        failures = self.scheduler.take_failures()
        if also is not None and all(rid != also for rid, _ in failures):
            failures.append((also, "the engine failed while admitting this request; the server log has why"))
        for rid, message in failures:
            for ended in [eid for eid in self.final_only if is_sample_of(eid, rid)]:
                self.final_only.discard(ended)
                self.held.pop(ended, None)
            self._to_frontend(RequestRejected(rid, None, message, internal=True))

    # --- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        self.structured.close()
        if self.kv_events is not None:  # the last changes, then the sockets
            self._publish_kv_events()
            self.kv_events.close()
        if self.workers is not None:
            self.workers.shutdown()
        for name in self.segments:
            shm.unlink_segment(name)
        self.segments = []
        self.from_frontend.close()
        self.to_frontend.close(linger_ms=2000 if os.getppid() == self.parent_pid else 0)
        self.ctx.term()
        if os.getppid() != self.parent_pid and self.input_endpoint.startswith("ipc://"):
            # the frontend died without cleaning up: its private socket folder goes too
            remove_ipc_dir(os.path.dirname(self.input_endpoint[len("ipc://") :]))

    def _to_frontend(self, message) -> None:
        if os.getppid() != self.parent_pid:  # the frontend that started this core is gone: no waiting on a send
            self.stopping = True
            raise EngineFailure("frontend process is gone")
        try:
            self.to_frontend.send(message, peer_timeout_ms=FRONTEND_GONE_MS)
        except PeerGone:
            self.stopping = True
            raise EngineFailure("frontend process is gone") from None

    def report_death(self, reason: str) -> None:
        if os.getppid() != self.parent_pid:
            return  # nobody to tell
        try:
            self.to_frontend.send(EngineDead(reason), peer_timeout_ms=1000)
        except (PeerGone, zmq.ZMQError):
            pass


def sampled_by_request(plan, result: StepResult) -> dict[str, int]:
    """The worker's sampled tokens by request id (prefill chunks that sampled nothing left out)."""
    return {rid: tok for rid, tok in zip(plan.num_scheduled_tokens, result.sampled_token_ids.tolist()) if tok >= 0}
