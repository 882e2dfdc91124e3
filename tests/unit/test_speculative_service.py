"""The draft path without an engine: `DraftCore` steps, the wire schemas, and the proposer's client
against the real StepServer and EndpointResolver over real ZeroMQ sockets.

Only Serve's handle is replaced (`Endpoints`: the resolver's one call, where the service is); the
step server answers from a real `DraftCore`, after a chosen delay. What is under test is the
deadline, skip and reconnect behaviour. The Serve path itself is tested with the running app in
tests/server/test_speculative_server.py and tests/server/test_faults.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from moonserve.pipeline.engine.proposer import DraftClient, ProposerStats, ShardedDraftClient
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.endpoint import PLAIN_USERNAME, EndpointResolver, StepServer
from moonserve.pipeline.speculative.ngram import NgramDrafter
from moonserve.pipeline.speculative.service import DraftCore
from moonserve.pipeline.speculative.shards import shard_of
from moonserve.pipeline.speculative.wire import Row, StepReply, StepRequest

# The service's mechanics, with every proposal as long as asked.
FIXED_K = AdaptivePolicy(enabled=False)
COPY = [7, 8, 9, 10, 11, 12, 13, 7, 8, 9]


def core(prefetch: bool = True) -> DraftCore:
    return DraftCore({"ngram": lambda: NgramDrafter(min_n=2, max_n=3)}, "ngram",
                     prefetch=prefetch, adaptive=FIXED_K)


def step(c: DraftCore, rows, k=3, release=()):
    reply, observation = c.step({"seq": 1, "k": k, "rows": rows, "release": list(release)})
    return reply, observation


def test_step_drafts_per_row_and_resends_when_tokens_are_missing():
    c = core()
    reply, obs = step(c, [["a", 0, COPY], ["b", 5, [1, 2]]])
    assert reply["drafts"] == [[10, 11, 12], []]
    assert reply["resend_from"] == [-1, 0]  # "b" was never opened: send from 0
    assert obs.num_resends == 1 and obs.num_drafts == [3, 0]
    reply, _ = step(c, [["b", 0, [1, 2, 1, 2]]])
    assert reply["drafts"] == [[1, 2]] and reply["resend_from"] == [-1]


def test_duplicate_step_from_another_rank_gets_the_same_drafts():
    c = core()
    first, _ = step(c, [["a", 0, COPY]])
    again, _ = step(c, [["a", 0, COPY]])
    assert first["drafts"] == again["drafts"]
    assert c.sessions.stats.num_truncations == 0


def test_prefetch_answers_a_fully_accepted_step_and_counts_acceptance():
    c = core()
    reply, _ = step(c, [["a", 0, COPY]])
    assert reply["drafts"] == [[10, 11, 12]]
    assert c.prefetch() == 1
    # The target accepted 10, 11, 12 and sampled 13 itself: the prefetch guessed that bonus.
    reply, obs = step(c, [["a", len(COPY), [10, 11, 12, 13]]])
    assert obs.prefetch_hits == 1 and obs.accepted == [3]
    assert reply["drafts"] == [[7, 8, 9]]
    # Partly rejected: the prefetch does not answer, the drafter does.
    c.prefetch()
    reply, obs = step(c, [["a", len(COPY) + 4, [7, 5]]])
    assert obs.prefetch_misses == 1 and obs.accepted == [1]


@pytest.mark.parametrize("how", ["configured", "switched"])
def test_without_prefetch_nothing_is_prefetched(how):
    c = core(prefetch=how == "switched")
    if how == "switched":
        c.set_drafter("ngram", prefetch=False)
    step(c, [["a", 0, COPY]])
    assert c.prefetch() == 0
    _, obs = step(c, [["a", len(COPY), [10, 11, 12, 13]]])
    assert obs.prefetch_hits == 0 and obs.accepted == [3]
    c.set_drafter("ngram", prefetch=True)
    step(c, [["a", 0, COPY]])
    assert c.prefetch() == 1


def test_release_and_switching_drafters_drop_sessions():
    c = DraftCore({"ngram": lambda: NgramDrafter(2, 3), "other": lambda: NgramDrafter(1, 1)},
                  "ngram")
    step(c, [["a", 0, COPY], ["b", 0, COPY]])
    step(c, [], release=["a"])
    assert c.summary()["num_sessions"] == 1
    c.set_drafter("other")
    assert c.summary()["num_sessions"] == 0 and c.summary()["drafter"] == "other"
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        c.set_drafter("nope")


def test_switching_to_the_suffix_drafter_again_forgets_earlier_responses():
    from moonserve.pipeline.speculative.suffix import SuffixDrafter

    c = DraftCore({"suffix": SuffixDrafter}, "suffix", adaptive=FIXED_K)
    response = [40, 41, 42, 43, 44]
    step(c, [["a", 0, [1, 2]]])
    step(c, [["a", 2, response]])
    assert step(c, [["b", 0, [9, 40, 41, 42]]])[0]["drafts"] == [[43, 44]]  # a's response
    c.set_drafter("suffix")
    assert step(c, [["c", 0, [9, 40, 41, 42]]])[0]["drafts"] == [[]]


def test_a_drafter_is_made_with_the_settings_set_drafter_is_given():
    from moonserve.pipeline.speculative.suffix import SuffixDrafter, SuffixSettings

    c = DraftCore({"suffix": lambda **s: SuffixDrafter(SuffixSettings(**s))}, "suffix")
    assert c.sessions.drafter.settings.max_spec_factor == 1.0
    c.set_drafter("suffix", settings={"max_spec_factor": 4.0})
    assert c.sessions.drafter.settings.max_spec_factor == 4.0
    c.factories["ngram"] = lambda: NgramDrafter(2, 3)
    with pytest.raises(ValueError, match="drafter 'ngram' takes no settings"):
        c.set_drafter("ngram", settings={"max_spec_factor": 4.0})
    assert c.active == "suffix"

    def broken(**settings):  # takes settings, fails inside: its own error, not "takes no settings"
        raise TypeError("a bug in the factory")

    c.factories["suffix"] = broken
    with pytest.raises(TypeError, match="a bug in the factory"):
        c.set_drafter("suffix", settings={"max_spec_factor": 4.0})


def test_the_step_threshold_from_the_engines_load_sets_each_requests_depth():
    """With no evidence a request's p is 0.5: the configured 0.3 allows one draft; the engine's
    0.1 allows three (0.5 ** 3 >= 0.1); past 1 only a probe goes out, then a pause that the
    proposer is handed."""
    c = DraftCore({"ngram": lambda: NgramDrafter(min_n=1, max_n=1)}, "ngram", prefetch=False)
    rows = [["a", 0, [5, 6, 7, 8, 9, 5]]]
    reply, obs = step(c, rows)
    assert reply["drafts"] == [[6]] and obs.min_acceptance == 0.3
    for threshold, expected in ((0.1, [[6, 7, 8]]), (1.5, [[6]])):
        c.set_drafter("ngram")  # a new session: no evidence again
        reply, obs = c.step({"seq": 2, "k": 4, "rows": rows, "release": [],
                             "min_acceptance": threshold})
        assert reply["drafts"] == expected and obs.min_acceptance == threshold
    assert c.summary()["min_acceptance"] == 1.5
    reply, _ = c.step({"seq": 3, "k": 4, "rows": [["a", 6, [6]]], "release": [],
                       "min_acceptance": 1.5})
    assert reply["drafts"] == [[]] and reply["quiet"] == [7]  # the probe's 8 steps, this one first


def test_step_request_keeps_its_wire_format_and_rejects_a_bad_one():
    request = StepRequest(seq=4, k=3, rows=[Row("a", 0, COPY)], release=["b"])
    payload = msgspec.msgpack.encode(request)
    # What DraftCore.step reads (and what the socket carried before the schema).
    assert msgspec.msgpack.decode(payload) == {
        "seq": 4, "k": 3, "rows": [["a", 0, COPY, -1, b""]], "release": ["b"],
        "stats": {"calls": 0, "skipped": 0, "missed": 0, "rtt_s": [], "quiet": 0},
        "hidden_dtype": "bfloat16", "min_acceptance": None}
    decoded = msgspec.msgpack.decode(payload, type=StepRequest)
    assert decoded == request
    assert msgspec.to_builtins(decoded, builtin_types=(bytes,))["rows"] == [["a", 0, COPY, -1, b""]]
    # A proposer of an older release sends three-element rows: they still decode.
    old = msgspec.msgpack.encode({"seq": 1, "k": 3, "rows": [["a", 0, [1]]]})
    assert msgspec.msgpack.decode(old, type=StepRequest).rows == [Row("a", 0, [1])]
    bad = msgspec.msgpack.encode({"seq": 1, "k": 3, "rows": [["a", "zero", [1]]]})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.rows\[0\]\[1\]"):
        msgspec.msgpack.decode(bad, type=StepRequest)


def test_draft_core_reply_fits_the_reply_schema():
    c = core()
    c.deadline_ms = 40
    reply, _ = c.step(msgspec.to_builtins(StepRequest(seq=2, k=3, rows=[Row("a", 0, COPY)])))
    assert msgspec.convert(reply, StepReply) == StepReply(
        seq=2, drafts=[[10, 11, 12]], resend_from=[-1], quiet=[0], deadline_ms=40.0)


class Endpoints:
    """Stands in for the DraftService handle's `endpoint.remote().result(timeout_s)`: the one
    Serve call of the draft path (discovery), answered from a real StepServer."""

    def __init__(self, server: StepServer | None):
        self.server = server
        self.calls = 0
        self.endpoint = self

    def remote(self):
        self.calls += 1
        return self

    def result(self, timeout_s=None):
        if self.server is None:
            raise TimeoutError("no DraftService replica")
        return self.server.endpoint()


class CoreHandler:
    """A StepServer handler answering from a real DraftCore after `delay_s`."""

    def __init__(self, delay_s: float = 0.0):
        self.core = core()
        self.delay_s = delay_s
        self.received = 0
        self.fail_next = False

    def __call__(self, message):
        self.received += 1
        time.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("drafter blew up")
        return self.core.step(message)[0], self.core.prefetch


@pytest.fixture
def servers():
    made = []

    def make(*objs):
        for obj in objs:
            obj.start()
            made.append(obj)
        return objs

    yield make
    for obj in made:
        obj.close()


@pytest.fixture
def clients():
    made = []

    def make(resolver_path, deadline_s):
        stats = ProposerStats()
        made.append(DraftClient(resolver_path, deadline_s=deadline_s, stats=stats))
        return made[-1], stats

    yield make
    for client in made:
        client.close()


def message(rows):
    return StepRequest(k=3, rows=[Row(*row) for row in rows])


def connected_client(step_server, servers, clients, deadline_s=2.0):
    resolver = EndpointResolver(Endpoints(step_server), timeout_s=1.0)
    servers(resolver)
    client, stats = clients(resolver.path, deadline_s)
    deadline = time.monotonic() + 5
    while not client.connected:  # resolving and the handshake take a few steps, none waits
        client.call(message([]))
        assert time.monotonic() < deadline, "client never connected"
        time.sleep(0.01)
    return client, stats, resolver


def test_client_gets_drafts_over_the_direct_connection(servers, clients):
    handler = CoreHandler()
    (step_server,) = servers(StepServer(handler, host="127.0.0.1"))
    client, stats, _ = connected_client(step_server, servers, clients)
    reply = client.call(message([["a", 0, COPY]]))
    assert reply.drafts == [[10, 11, 12]] and reply.resend_from == [-1]
    assert stats.calls >= 1 and len(stats.rtt_s) == stats.calls


def test_a_failed_step_gets_an_error_reply_and_the_server_goes_on(servers, clients):
    handler = CoreHandler()
    (step_server,) = servers(StepServer(handler, host="127.0.0.1"))
    client, _, _ = connected_client(step_server, servers, clients)
    handler.fail_next = True
    reply = client.call(message([["a", 0, COPY]]))
    assert reply.seq == client.seq and reply.drafts == []
    assert reply.error == "RuntimeError: drafter blew up"
    assert client.call(message([["a", 0, COPY]])).drafts == [[10, 11, 12]]


def test_a_slow_service_costs_one_deadline_then_steps_skip_until_it_answers(servers, clients):
    handler = CoreHandler(delay_s=0.5)
    (step_server,) = servers(StepServer(handler, host="127.0.0.1"))
    client, stats, _ = connected_client(step_server, servers, clients, deadline_s=0.05)
    assert client.call(message([["a", 0, COPY]])) is None
    assert stats.missed == 1
    # The first call is still pending: this step sends nothing and waits for nothing.
    skipped = stats.skipped
    assert client.call(message([["a", 0, COPY]])) is None
    assert stats.skipped == skipped + 1 and handler.received == 1
    time.sleep(0.6)  # the late reply arrives; it is dropped, the next call goes through
    handler.delay_s = 0.0
    reply = client.call(message([["a", 0, COPY]]))
    assert reply is not None and reply.seq == client.seq and handler.received == 2


def test_a_connection_without_the_token_is_refused(servers):
    handler = CoreHandler()
    (step_server,) = servers(StepServer(handler, host="127.0.0.1"))
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.plain_username, sock.plain_password = PLAIN_USERNAME.encode(), b"guess"
        sock.connect(f"tcp://{step_server.endpoint()['endpoint']}")
        sock.send(msgspec.msgpack.encode(StepRequest(seq=1, k=3, rows=[Row("a", 0, COPY)])))
        assert sock.poll(500) == 0  # refused in the handshake: no answer
    assert handler.received == 0


def test_an_oversized_step_drops_its_connection_unread_and_others_go_on(servers, clients):
    handler = CoreHandler()
    (step_server,) = servers(StepServer(handler, host="127.0.0.1", max_message_bytes=1024))
    token = step_server.endpoint()["token"]
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.plain_username, sock.plain_password = PLAIN_USERNAME.encode(), token.encode()
        sock.connect(f"tcp://{step_server.endpoint()['endpoint']}")
        big = StepRequest(seq=1, k=3, rows=[Row("a", 0, list(range(1000)))])
        sock.send(msgspec.msgpack.encode(big))  # about 2 KB: over the bound
        assert sock.poll(500) == 0  # dropped: no answer
    assert handler.received == 0
    client, _, _ = connected_client(step_server, servers, clients)
    assert client.call(message([["a", 0, COPY]])).drafts == [[10, 11, 12]]


def test_a_refused_client_reports_the_address_stale(servers, clients, monkeypatch):
    monkeypatch.setattr("moonserve.pipeline.engine.proposer.RECONNECT_INTERVAL_S", 0.05)
    (step_server,) = servers(StepServer(CoreHandler(), host="127.0.0.1"))
    resolver = EndpointResolver(Endpoints(step_server), timeout_s=1.0)
    servers(resolver)
    resolver.resolve(None).token = "guess"  # the resolver hands out a wrong token once
    client, stats = clients(resolver.path, 0.05)
    deadline = time.monotonic() + 5
    while resolver.handle.calls < 2:  # refused, so the client asks for the address again
        assert client.call(message([["a", 0, COPY]])) is None
        assert time.monotonic() < deadline, "the refused address was never reported stale"
        time.sleep(0.01)
    assert stats.calls == 0 and client.stale == step_server.endpoint()["endpoint"]


def test_a_replaced_service_is_found_again_through_the_resolver(servers, clients, monkeypatch):
    monkeypatch.setattr("moonserve.pipeline.engine.proposer.RECONNECT_INTERVAL_S", 0.05)
    first = StepServer(CoreHandler(), host="127.0.0.1")
    servers(first)
    client, _, resolver = connected_client(first, servers, clients)
    assert client.call(message([["a", 0, COPY]])).drafts == [[10, 11, 12]]
    first.close()  # the replica dies: Serve starts another one elsewhere
    replacement = StepServer(CoreHandler(), host="127.0.0.1")
    servers(replacement)
    resolver.handle.server = replacement
    deadline = time.monotonic() + 5
    while (reply := client.call(message([["a", 0, COPY]]))) is None:
        assert time.monotonic() < deadline, "the client did not find the new replica"
        time.sleep(0.02)
    assert reply.drafts == [[10, 11, 12]]  # a new session, from position 0
    assert resolver.handle.calls == 2  # asked Serve again only because the old address was stale


class LoopEndpoints(Endpoints):
    """The handle as Serve makes it with `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`: a call routes
    on the calling thread's running loop (none: RuntimeError, as `CurrentLoopRouter` raises), and
    its response is awaited there."""

    def __init__(self, server: StepServer):
        super().__init__(server)
        self.threads: set[str] = set()

    def remote(self):
        asyncio.get_running_loop()  # RuntimeError off the loop
        self.threads.add(threading.current_thread().name)
        self.calls += 1
        return self._answer()

    async def _answer(self):
        return self.server.endpoint()


def test_a_resolver_made_on_a_loop_calls_the_handle_on_that_loop(servers, clients):
    """In the replica the resolver is made on the replica's loop; its own thread only waits."""
    (step_server,) = servers(StepServer(CoreHandler(), host="127.0.0.1"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="replica-loop", daemon=True)
    thread.start()
    try:
        async def make():
            return EndpointResolver(LoopEndpoints(step_server), timeout_s=1.0)

        resolver = asyncio.run_coroutine_threadsafe(make(), loop).result(5)
        servers(resolver)
        client, _ = clients(resolver.path, 2.0)
        deadline = time.monotonic() + 5
        while not client.connected:
            client.call(message([]))
            assert time.monotonic() < deadline, "client never connected"
            time.sleep(0.01)
        assert client.call(message([["a", 0, COPY]])).drafts == [[10, 11, 12]]
        assert resolver.handle.threads == {"replica-loop"}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


# The call was dropped before the loop ever ran it.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_resolver_whose_loop_is_busy_answers_an_error_after_its_timeout(servers):
    """A loop that does not run the call (blocked: the replica's constructor is starting the
    engine) costs the query `timeout_s`, then an error answer; the proposer asks again later."""
    (step_server,) = servers(StepServer(CoreHandler(), host="127.0.0.1"))
    loop = asyncio.new_event_loop()
    resolver = EndpointResolver(LoopEndpoints(step_server), timeout_s=0.2)
    resolver.loop = loop  # never run: as busy as a loop can be
    started = time.monotonic()
    answer = resolver.resolve(None)
    assert 0.2 <= time.monotonic() - started < 1.0
    assert answer.error.startswith("TimeoutError") and answer.endpoint is None
    assert resolver.handle.calls == 0
    resolver.close()
    loop.close()


def test_no_service_means_no_drafts_and_no_waiting(servers, clients, monkeypatch):
    monkeypatch.setattr("moonserve.pipeline.engine.proposer.RECONNECT_INTERVAL_S", 0.05)
    resolver = EndpointResolver(Endpoints(None), timeout_s=0.1)
    servers(resolver)
    client, stats = clients(resolver.path, 0.05)
    for _ in range(20):
        assert client.call(message([["a", 0, COPY]])) is None
        time.sleep(0.02)
    assert stats.calls == 0 and stats.missed == 0 and stats.skipped == 20
    assert resolver.handle.calls >= 2  # it keeps asking, a little later each time


def test_the_service_can_raise_the_deadline_even_with_late_replies(servers, clients):
    handler = CoreHandler(delay_s=0.2)
    handler.core.deadline_ms = 1000.0
    (step_server,) = servers(StepServer(handler, host="127.0.0.1"))
    client, _, _ = connected_client(step_server, servers, clients, deadline_s=0.05)
    assert client.call(message([["a", 0, COPY]])) is None  # missed: 200 ms > 50 ms
    time.sleep(0.3)
    client.call(message([["a", 0, COPY]]))  # reads the late reply, adopts its deadline
    assert client.deadline_s == 1.0
    assert client.call(message([["a", 0, COPY]])).drafts == [[10, 11, 12]]


class ShardEndpoints:
    """The DraftService handle as a sharded resolver uses it: `endpoint.remote(shard)` answers
    from the step server `ShardRouter` would pick, here `route[shard]`."""

    def __init__(self, route: dict[int, StepServer]):
        self.route = route
        self.endpoint = self
        self.asked: list[int] = []

    def remote(self, shard):
        self.asked.append(shard)
        server = self.route[shard]
        return type("Result", (), {"result": lambda _, timeout_s=None: server.endpoint()})()


def sharded_client(route, servers, refresh_s=10.0):
    resolver = EndpointResolver(ShardEndpoints(route), timeout_s=1.0, shards=len(route),
                                refresh_s=refresh_s)
    servers(resolver)
    client = ShardedDraftClient(resolver.path, deadline_s=2.0, stats=ProposerStats(),
                                shards=len(route), refresh_s=refresh_s)
    # A shard's client resolves and connects when a step has rows for it.
    warm = [ids[0] for ids in ids_by_shard(16, len(route), prefix="warm").values()]
    deadline = time.monotonic() + 5
    while not all(c.connected for c in client.clients):
        client.call(message([[rid, 0, [1]] for rid in warm]))
        assert time.monotonic() < deadline, "the shards never connected"
        time.sleep(0.01)
    return client, resolver


class RecordingHandler(CoreHandler):
    def __init__(self):
        super().__init__()
        self.request_ids: set[str] = set()

    def __call__(self, message):
        self.request_ids |= {row[0] for row in message["rows"]}
        return super().__call__(message)


def ids_by_shard(n_ids: int, shards: int, prefix: str = "req") -> dict[int, list[str]]:
    by_shard: dict[int, list[str]] = {}
    for k in range(n_ids):
        by_shard.setdefault(shard_of(f"{prefix}-{k}", shards), []).append(f"{prefix}-{k}")
    return by_shard


def test_a_step_sends_each_shard_its_own_rows_and_merges_the_replies(servers):
    handlers = [RecordingHandler(), RecordingHandler()]
    step_servers = servers(*(StepServer(h, host="127.0.0.1") for h in handlers))
    client, _ = sharded_client(dict(enumerate(step_servers)), servers)
    for h in handlers:  # what connecting sent
        h.request_ids.clear()
        h.received = 0
    try:
        ids = [f"req-{k}" for k in range(8)]
        reply = client.call(message([[rid, 0, COPY] for rid in ids]))
        assert reply.drafts == [[10, 11, 12]] * 8 and reply.resend_from == [-1] * 8
        by_shard = ids_by_shard(8, 2)
        assert [h.request_ids for h in handlers] == [set(by_shard[0]), set(by_shard[1])]
        # One message per shard per step, all sent before any reply is read.
        assert [h.received for h in handlers] == [1, 1]
    finally:
        client.close()


def test_a_lost_shard_costs_its_own_rows_only(servers, monkeypatch):
    monkeypatch.setattr("moonserve.pipeline.engine.proposer.RECONNECT_INTERVAL_S", 60)
    handlers = [RecordingHandler(), RecordingHandler()]
    step_servers = servers(*(StepServer(h, host="127.0.0.1") for h in handlers))
    client, _ = sharded_client(dict(enumerate(step_servers)), servers)
    try:
        step_servers[1].close()
        by_shard = ids_by_shard(8, 2)
        rows = [[rid, 0, COPY] for rid in by_shard[0] + by_shard[1]]
        deadline = time.monotonic() + 5
        while client.clients[1].connected:  # the connection's loss reaches the client
            reply = client.call(message(rows))
            assert time.monotonic() < deadline, "the lost shard was never noticed"
        reply = client.call(message(rows))
        n0 = len(by_shard[0])
        assert reply.drafts[:n0] == [[10, 11, 12]] * n0 and reply.resend_from[:n0] == [-1] * n0
        # Shard 1's rows: no drafts, resent from where they were.
        assert reply.drafts[n0:] == [[]] * len(by_shard[1])
        assert reply.resend_from[n0:] == [0] * len(by_shard[1])
    finally:
        client.close()


def test_a_shard_follows_its_replica_back_after_a_restart(servers):
    home, stand_in = RecordingHandler(), RecordingHandler()
    home_server, stand_in_server = servers(StepServer(home, host="127.0.0.1"),
                                           StepServer(stand_in, host="127.0.0.1"))
    # Shard 1's replica is down: Serve's router gives shard 1 the other replica meanwhile.
    route = {0: stand_in_server, 1: stand_in_server}
    client, resolver = sharded_client(route, servers, refresh_s=0.1)
    try:
        rid = ids_by_shard(16, 2)[1][0]
        assert client.call(message([[rid, 0, COPY]])).drafts == [[10, 11, 12]]
        assert rid in stand_in.request_ids
        route[1] = home_server  # back: the next refresh sends shard 1 home
        deadline = time.monotonic() + 5
        position = len(COPY)
        while rid not in home.request_ids:
            reply = client.call(message([[rid, position, [7]]]))
            if reply is not None and reply.resend_from[0] >= 0:  # a new session: resend all
                position = reply.resend_from[0]
                reply = client.call(message([[rid, position, (COPY + [7])[position:]]]))
            assert time.monotonic() < deadline, "shard 1 never went back to its replica"
            time.sleep(0.02)
        assert resolver.handle.asked.count(1) >= 2
    finally:
        client.close()


def test_the_shard_router_sends_a_named_shard_to_its_replica():
    import asyncio
    from types import SimpleNamespace

    from moonserve.pipeline.router.draft_shards import ShardRouter
    from moonserve.pipeline.speculative.shards import requested_shard

    def replica(name):
        return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: name))

    def call(method, *args, **kwargs):
        return SimpleNamespace(args=args, kwargs=kwargs,
                               metadata=SimpleNamespace(call_method=method))

    replicas = [replica(n) for n in ("c", "a", "b")]
    for shard, expected in ((0, "a"), (1, "b"), (2, "c"), (4, "b")):
        (rank,) = asyncio.run(ShardRouter.choose_replicas(None, replicas, call("endpoint", shard)))
        assert [r.replica_id.to_full_id_str() for r in rank] == [expected]
    assert requested_shard(call("set_drafter", "none", shard=3)) == 3
    assert requested_shard(call("set_deadline", 1000)) is None  # a deadline, not a shard
    assert requested_shard(call("endpoint", True)) is None
