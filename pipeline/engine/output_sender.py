"""The LanguageModel replica's side of the output channel (`moonserve.pipeline.engine.output_wire`).

The replica hosts vLLM's engine but not its output processing: `EngineOutputs` reads what the
engine core produces each step (`EngineCoreOutputs`, the same objects vLLM's own frontend reads)
and sends each Router its requests' share as one frame, over that Router's `RouterConnection`.
The Router detokenizes, checks stop strings and logprobs (vLLM's `OutputProcessor`), and sends
back the ids of requests a stop string ended, which are aborted here. What the replica does per
token is a dictionary lookup and the stats vLLM's metrics need (`vllm.v1.metrics.stats`).

Example (inside a replica's event loop, `engine` an AsyncLLM):
    >>> outputs = EngineOutputs(engine)
    >>> connection = await outputs.connections.get(address)                  # doctest: +SKIP
    >>> num_tokens = await outputs.run(engine_core_request, connection)      # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from moonserve.pipeline.api.background import in_background
from moonserve.pipeline.engine.output_wire import (
    ABORT,
    OUTPUTS,
    REQUEST,
    ChannelAddress,
    FrameError,
    FrameReader,
    WireDecoders,
    WireEncoder,
    encode_frame,
    fan_out,
    for_the_router,
)

logger = logging.getLogger("moonserve.language_model")

# Bytes a Router may leave unread. The output loop never waits for one Router (that would stall
# every other Router's streams); a Router this far behind is taken as stuck: its connection is
# closed and its requests end with an error (ChannelLost there), aborted in the engine here.
MAX_UNREAD_BYTES = 64 * 1024 * 1024


class RouterConnection(asyncio.Protocol):
    """One connection to one Router replica: frames out, abort requests in. `owner` gets the
    Router's aborts (`abort_stopped(ids)`) and the connection's end (`connection_gone(self)`)."""

    def __init__(self, owner):
        self.owner = owner
        self.encoder = WireEncoder()
        self.decoders = WireDecoders()
        self.reader = FrameReader(None)
        self.transport: asyncio.Transport | None = None
        self.pending: list = []  # this step's EngineCoreOutputs for this Router

    @classmethod
    async def connect(cls, address: ChannelAddress, owner) -> RouterConnection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: cls(owner), address.host,
                                                     address.port)
        connection.transport.write(address.token)
        return connection

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_gone(self)

    def data_received(self, data: bytes) -> None:
        try:
            for kind, body in self.reader.feed(data):
                if kind != ABORT:
                    raise FrameError(f"a Router sent a frame of kind {kind}")
                self.owner.abort_stopped(self.decoders.decode(kind, body))
        except FrameError as exc:
            logger.warning("output channel to %s closed: %s",
                           self.transport.get_extra_info("peername"), exc)
            self.transport.close()

    @property
    def closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def send_request(self, request) -> None:
        """The request's EngineCoreRequest (as the Router needs it), before any of its outputs."""
        if self.closed:
            raise ConnectionResetError("the Router's output channel is closed")
        self.transport.write(encode_frame(self.encoder, REQUEST, for_the_router(request)))

    def flush(self, outputs_type, engine_index: int, timestamp: float) -> None:
        """This step's outputs for this Router as one frame (nothing once the Router is gone)."""
        outputs, self.pending = self.pending, []
        if outputs and not self.closed:
            frame = outputs_type(engine_index=engine_index, outputs=outputs, timestamp=timestamp)
            self.transport.write(encode_frame(self.encoder, OUTPUTS, frame))
            if self.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
                logger.warning("output channel to %s closed: the Router left over %d bytes "
                               "unread", self.transport.get_extra_info("peername"),
                               MAX_UNREAD_BYTES)
                self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class RouterConnections:
    """The replica's connections, one per Router address, opened on first use."""

    def __init__(self, owner):
        self.owner = owner
        self.connections: dict[ChannelAddress, asyncio.Future[RouterConnection]] = {}

    async def get(self, address: ChannelAddress) -> RouterConnection:
        connecting = self.connections.get(address)
        if connecting is None or not usable(connecting):
            connecting = self.connections[address] = asyncio.ensure_future(
                RouterConnection.connect(address, self.owner))
        return await asyncio.shield(connecting)

    def close(self) -> None:
        for connecting in self.connections.values():
            if connecting.done() and usable(connecting):
                connecting.result().close()
            connecting.cancel()
        self.connections.clear()


def usable(connecting: asyncio.Future[RouterConnection]) -> bool:
    """Still connecting, or connected and open (not failed, not closed by the Router)."""
    if not connecting.done():
        return True
    return not connecting.cancelled() and connecting.exception() is None and \
        not connecting.result().closed


@dataclass
class EngineRequestState:
    """What vLLM's OutputProcessor keeps of one engine request for its metrics."""

    stats: object  # vllm.v1.metrics.stats.RequestStateStats
    prefilling: bool = True
    num_cached_tokens: int = 0


@dataclass(eq=False)  # one per request, compared and hashed by identity
class Route:
    """One request on its way: where its outputs go, and its engine requests still running (one
    per choice; `parent` is vLLM's ParentRequest when n > 1) with their stats."""

    request_id: str  # the request's own (vLLM's external_req_id), as vLLM's stats name it
    connection: RouterConnection
    prompt_len: int
    max_tokens: int | None
    parent: object | None
    done: asyncio.Future
    running: dict[str, EngineRequestState] = field(default_factory=dict)
    num_tokens: int = 0


class EngineOutputs:
    """The engine's output loop: every step's outputs to their Routers, one frame per Router."""

    def __init__(self, engine):
        from vllm.v1.engine import EngineCoreOutputs

        # AsyncLLM starts its own output handler when it is made inside a running loop (Serve
        # makes a replica there); two readers of one engine's outputs would each get some steps.
        if engine.output_handler is not None:
            engine.output_handler.cancel()
            engine.output_handler = None  # AsyncLLM.errored counts a finished handler as dead
        self.engine = engine
        self.outputs_type = EngineCoreOutputs
        self.routes: dict[str, Route] = {}  # engine request id (each child of n) -> its request
        self.connections = RouterConnections(self)
        self.loop_task: asyncio.Task | None = None
        self.error: BaseException | None = None

    async def run(self, request, connection: RouterConnection) -> int:
        """Run one EngineCoreRequest (fanned out when n > 1) with its outputs going over
        `connection`; returns its output tokens. Cancelling this aborts it in the engine."""
        from vllm.v1.metrics.stats import RequestStateStats

        if self.error is not None:
            raise self.error
        self.start()
        parent, children = fan_out(request)
        params = request.sampling_params
        route = Route(request.external_req_id, connection,
                      len(request.prompt_token_ids or request.prompt_embeds),
                      params.max_tokens if params else None, parent,
                      done=asyncio.get_running_loop().create_future())
        connection.send_request(request)
        ids = [child.request_id for child in children]
        for child in children:
            self.routes[child.request_id] = route
            route.running[child.request_id] = EngineRequestState(
                RequestStateStats(arrival_time=request.arrival_time))
        try:
            for child in children:
                await self.engine.engine_core.add_request_async(child)
            await route.done
        finally:
            if route.running:
                # The caller went away (client disconnect, cancel), the Router's connection
                # closed, or the engine failed.
                await asyncio.shield(self.abort(ids))
        return route.num_tokens

    async def abort(self, request_ids: list[str]) -> None:
        live = [i for i in request_ids if self.routes.pop(i, None) is not None]
        if live:
            await self.engine.engine_core.abort_requests_async(live)

    def abort_stopped(self, request_ids: list[str]) -> None:
        """A Router's stop strings ended these (vLLM's `reqs_to_abort`): count them finished
        (`stop`, as vLLM's frontend counts them), abort them in the engine, and end their
        requests here."""
        from vllm.v1.engine import FinishReason
        from vllm.v1.metrics.stats import IterationStats

        live = [i for i in request_ids if i in self.routes]
        if not live:
            return
        stats = IterationStats()
        for request_id in live:
            route = self.routes.pop(request_id)
            self.count_finished(route, request_id, FinishReason.STOP, stats)
            self.end(route, request_id)
        self.record(0, None, stats)
        in_background(self.engine.engine_core.abort_requests_async(live),
                      "aborting requests a stop string ended")

    def connection_gone(self, connection: RouterConnection) -> None:
        """The Router is gone (or closed the connection): its requests end with an error, so
        their calls abort them in the engine."""
        lost = ConnectionResetError("the Router's output channel closed")
        for route in {r for r in self.routes.values() if r.connection is connection}:
            if not route.done.done():
                route.done.set_exception(lost)

    def start(self) -> None:
        if self.loop_task is None:
            self.loop_task = asyncio.ensure_future(self.output_loop())

    async def output_loop(self) -> None:
        from vllm.v1.metrics.stats import IterationStats

        engine_core = self.engine.engine_core
        try:
            while True:
                outputs = await engine_core.get_output_async()
                stats = IterationStats() if outputs.outputs else None
                touched = self.route_outputs(outputs, stats)
                for connection in touched:
                    connection.flush(self.outputs_type, outputs.engine_index, outputs.timestamp)
                self.record(outputs.engine_index, outputs.scheduler_stats, stats)
        except Exception as exc:  # the engine core is gone: every request ends with it
            logger.exception("the engine's output loop failed")
            self.fail_all(exc)

    def route_outputs(self, outputs, stats) -> set[RouterConnection]:
        touched = set()
        for output in outputs.outputs:
            route = self.routes.get(output.request_id)
            if route is None:
                continue  # aborted: its last outputs go nowhere
            route.connection.pending.append(output)
            touched.add(route.connection)
            route.num_tokens += len(output.new_token_ids)
            if stats is not None:
                self.count(route, output, outputs.timestamp, stats)
            if output.finish_reason is not None:
                self.end(self.routes.pop(output.request_id), output.request_id)
        return touched

    def count(self, route: Route, output, timestamp: float, stats) -> None:
        """vLLM's iteration stats, as its OutputProcessor counts them."""
        request_id = output.request_id
        state = route.running[request_id]
        lora_states = self.engine.output_processor.lora_states
        if output.events:
            stats.update_from_events(request_id, output.events, state.prefilling, state.stats,
                                     lora_states, None)
        stats.update_from_output(output, timestamp, state.prefilling, state.stats, lora_states,
                                 None)
        if state.prefilling and output.prefill_stats is not None:
            state.num_cached_tokens = output.prefill_stats.num_cached_tokens
        state.prefilling = False
        if output.finish_reason is not None:
            self.count_finished(route, request_id, output.finish_reason, stats)

    @staticmethod
    def count_finished(route: Route, request_id: str, finish_reason, stats) -> None:
        from vllm.v1.engine.parallel_sampling import ParentRequest

        state = route.running[request_id]
        stats.update_from_finished_request(
            finish_reason=finish_reason, request_id=route.request_id,
            num_prompt_tokens=route.prompt_len,
            max_tokens_param=route.max_tokens, req_stats=state.stats,
            num_cached_tokens=state.num_cached_tokens)
        if route.parent is not None:
            route.parent.child_requests.discard(request_id)
        ParentRequest.observe_finished_request(route.parent, stats,
                                               state.stats.num_generation_tokens)

    @staticmethod
    def end(route: Route, request_id: str) -> None:
        route.running.pop(request_id, None)
        if not route.running and not route.done.done():
            route.done.set_result(None)

    def record(self, engine_index: int, scheduler_stats, stats) -> None:
        loggers = self.engine.logger_manager
        if loggers is not None:
            loggers.record(engine_idx=engine_index, scheduler_stats=scheduler_stats,
                           iteration_stats=stats)

    def fail_all(self, exc: BaseException) -> None:
        self.error = exc
        for route in set(self.routes.values()):
            if not route.done.done():
                route.done.set_exception(exc)
        self.routes.clear()

    def close(self) -> None:
        self.connections.close()
        if self.loop_task is not None:
            self.loop_task.cancel()

