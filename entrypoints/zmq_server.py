"""The ZMQ entrypoint: a ROUTER socket that many DEALER clients talk to at once
(protocol: entrypoints/zmq_protocol.py, docs/zmq-protocol.md). Request ids are the client's,
scoped to its connection. A frame that cannot be read, or whose handling fails in any way,
gets an error reply and touches no other request; a client that disconnects has its requests
aborted when the next message to it cannot be routed. Should the socket loop itself end
unexpectedly, `dead_reason` says why (and /health reports it)."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging

import msgspec
import zmq
import zmq.asyncio

from pagedllm.core.errors import InvalidParameter, RequestFailed

from .async_engine import AsyncEngine, EngineOverloaded, RequestStream
from .engine_client import EngineDeadError
from .limits import RequestTooLarge, ServerLimits
from .zmq_auth import ServerCurve
from .zmq_protocol import (
    Abort,
    ClientMessage,
    Completion,
    Delta,
    Error,
    Final,
    Generate,
    Hello,
    Ready,
    Usage,
    invalid_message,
    lora_request,
    readable_request_id,
    sampling_params,
    wire_field,
)

logger = logging.getLogger("pagedllm.entrypoints")


class ClientGone(Exception):
    pass


class ZmqServer:
    def __init__(
        self,
        engine: AsyncEngine,
        endpoint: str,
        model_name: str = "pagedllm",
        curve: ServerCurve | None = None,
        limits: ServerLimits | None = None,
    ):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits or ServerLimits()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.auth = curve.apply(self.ctx, self.sock) if curve is not None else None
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished client raises
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        # frames past the limit get a 413 reply; far past it, ZeroMQ drops the connection unread
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.limits.max_request_bytes + 4096)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--zmq-endpoint: cannot bind {endpoint}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._replies: set[asyncio.Task] = set()  # error replies on their way
        self._ids = itertools.count()
        self.dead_reason: str | None = None  # why serve() ended, if not by being cancelled

    async def serve(self) -> None:
        """Answer clients until cancelled."""
        try:
            while True:
                frames = await self.sock.recv_multipart()
                try:
                    self._handle(frames[0], frames[1:])
                except Exception:  # a bug met by one frame: that client hears of it, others go on
                    logger.exception("a ZMQ message could not be handled")
                    self._reply_soon(frames[0], Error(None, 500, None, "internal error (the server log has why)"))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.dead_reason = f"the ZMQ entrypoint stopped: {e!r}"
            logger.exception("the ZMQ entrypoint stopped")
            raise
        finally:
            for task in list(self.tasks.values()):
                task.cancel()

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(linger=0)
        self.ctx.term()

    # --- requests ---------------------------------------------------------------------------
    def _handle(self, identity: bytes, payload: list[bytes]) -> None:
        if len(payload) != 1:
            self._reply_soon(identity, Error(None, 400, None, f"expected one frame per message, got {len(payload)}"))
            return
        try:
            self.limits.check_size(len(payload[0]), "frame")
        except RequestTooLarge as e:
            self._reply_soon(identity, Error(None, 413, None, str(e)))
            return
        try:
            msg = self.decoder.decode(payload[0])
        except msgspec.ValidationError as e:
            field, message = invalid_message(e)
            error = Error(readable_request_id(payload[0]), 400, field, f"not a valid message: {message}")
            self._reply_soon(identity, error)
            return
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            self._reply_soon(identity, Error(None, 400, None, f"not a msgpack message: {e}"))
            return
        except RecursionError:
            self._reply_soon(identity, Error(None, 400, None, "the message nests arrays or maps too deeply to be read"))
            return
        if isinstance(msg, Hello):
            self._reply_soon(identity, Ready(self.model_name, self.engine.max_model_len))
        elif isinstance(msg, Abort):
            task = self.tasks.get((identity, msg.request_id))
            if task is not None:  # an id that already finished is no error: the two crossed
                task.cancel()
        else:
            self._generate(identity, msg)

    def _generate(self, identity: bytes, msg: Generate) -> None:
        key = (identity, msg.request_id)
        if key in self.tasks:  # refuses the duplicate only: the running request goes on
            self._reply_soon(
                identity, Error(msg.request_id, 409, "request_id", f"request {msg.request_id!r} is still running")
            )
            return
        try:
            params = sampling_params(msg.params)
            self.limits.check(params, wire_field)
            prompt = self.engine.prepare(self._prompt(msg))
            lens = [len(prompt["prompt_token_ids"])]
            params = self.engine.logprobs_asked(params)
            self.limits.check_logprob_entries(params, lens, self.engine.max_model_len, wire_field)
            lora = lora_request(msg.params)
            try:
                stream = self.engine.add_request(prompt, params, request_id=f"zmq-{next(self._ids)}", lora=lora)
            except InvalidParameter as e:  # the adapter's refusal, named as this protocol names it
                raise e.renamed("params.lora") if e.field == "lora_request" else e from None
        except InvalidParameter as e:
            self._reply_soon(identity, Error(msg.request_id, 400, wire_field(e.field), str(e)))
            return
        except EngineOverloaded as e:
            self._reply_soon(identity, Error(msg.request_id, 503, None, str(e)))
            return
        except EngineDeadError as e:
            self._reply_soon(identity, Error(msg.request_id, 500, None, str(e)))
            return
        self.tasks[key] = asyncio.create_task(self._run(identity, msg, stream))

    @staticmethod
    def _prompt(msg: Generate):
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise InvalidParameter("prompt", "give exactly one of prompt and prompt_token_ids")
        return msg.prompt if msg.prompt is not None else msg.prompt_token_ids

    async def _run(self, identity: bytes, msg: Generate, stream: RequestStream) -> None:
        rid = msg.request_id
        output = stream.tracker.output
        try:
            try:
                async for out in stream:
                    if msg.stream and out.delta_token_ids:
                        lps = tops = None
                        if out.delta_logprobs is not None and not stream.tracker.beams:
                            lps, tops = _token_logprobs(
                                out.delta_token_ids, out.delta_logprobs, stream.tracker.params.logprobs
                            )
                        delta = Delta(rid, out.index, out.delta_text, out.delta_token_ids, lps, tops)
                        await self._send(identity, delta)
            except asyncio.CancelledError:  # the client aborted, or the server is stopping
                stream.close()
                await self._send(identity, self._final(rid, output, stream.tracker.params))
                return
            except (EngineDeadError, RequestFailed) as e:
                await self._send(identity, Error(rid, 500, None, str(e)))
                return
            except InvalidParameter as e:  # refused by the engine core (e.g. a beam search too big for the pool)
                await self._send(identity, Error(rid, 400, wire_field(e.field), str(e)))
                return
            except ClientGone:
                raise
            except Exception:  # a bug here must not leave the client waiting
                logger.exception("ZMQ request %r failed", rid)
                await self._send(identity, Error(rid, 500, None, "internal error (the server log has why)"))
                return
            await self._send(identity, self._final(rid, output, stream.tracker.params))
        except ClientGone:
            self._forget_client(identity)
        except asyncio.CancelledError:
            pass
        finally:
            stream.close()
            if self.tasks.get((identity, rid)) is asyncio.current_task():
                del self.tasks[(identity, rid)]

    @staticmethod
    def _final(rid: str, output, params) -> Final:
        lps = tops = None
        if output.prompt_logprobs is not None:
            entries = output.prompt_logprobs[1:]
            ids = output.prompt_token_ids[1 : 1 + len(entries)]
            lps, tops = _token_logprobs(ids, entries, params.prompt_logprobs)
            lps, tops = [None, *lps], [[], *tops]
        return Final(
            rid,
            [
                Completion(
                    c.index, c.text, c.token_ids, c.finish_reason or "abort", c.stop_reason, c.cumulative_logprob
                )
                for c in output.outputs
            ],
            Usage(
                len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs), output.num_cached_tokens
            ),
            lps,
            tops,
        )

    # --- sending ----------------------------------------------------------------------------
    async def _send(self, identity: bytes, msg) -> None:
        try:
            await self.sock.send_multipart([identity, self.encoder.encode(msg)])
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                raise ClientGone() from None
            raise

    def _reply_soon(self, identity: bytes, msg) -> None:
        async def reply():
            try:
                await self._send(identity, msg)
            except ClientGone:
                pass

        task = asyncio.ensure_future(reply())
        self._replies.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._replies.discard)

    def _forget_client(self, identity: bytes) -> None:
        """The client vanished: abort all its requests."""
        for (who, _), task in list(self.tasks.items()):
            if who == identity and task is not asyncio.current_task():
                task.cancel()


def _token_logprobs(token_ids: list[int], entries: list[dict], k: int) -> tuple[list[float], list[list]]:
    """The tokens' log-probabilities, and for each the k most likely (token id, logprob)."""
    sampled = [entry[t].logprob for t, entry in zip(token_ids, entries)]
    by_rank = [sorted((e.rank, t, e.logprob) for t, e in entry.items() if e.rank <= k) for entry in entries]
    return sampled, [[(t, lp) for _, t, lp in ranked] for ranked in by_rank]
