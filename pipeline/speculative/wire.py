"""The draft step messages between vLLM's proposer and the DraftService: msgspec schemas.

They travel msgpack-encoded, one per ZeroMQ message (`moonserve.pipeline.speculative.endpoint`).
Once per engine step the proposer sends one `StepRequest` for the whole batch and reads one
`StepReply` with the same `seq` (one of each per shard when the DraftService has several replicas);
to find a shard's replica it asks the LM replica's resolver with an `EndpointQuery` and gets an
`EndpointAnswer`. Decoding validates a message against its schema
(`msgspec.ValidationError`, a `msgspec.DecodeError`, names the bad field).

On the wire a request is the map `{"seq", "k", "rows", "release", "stats", "hidden_dtype"}`, each
row the array `[request_id, position, [new token ids], hidden_start, hidden bytes]` (the last two
-1 and empty without the target's hidden states); the DraftService's handler gets exactly that as
plain Python (`msgspec.to_builtins` keeping bytes, see `DraftCore.step`). `position` is how many
context tokens the proposer believes the service holds (see
`moonserve.pipeline.speculative.sessions`); a row whose position is ahead of the service (lost
call, service restarted) comes back with `resend_from` and no drafts.

Example:
    >>> payload = msgspec.msgpack.encode(StepRequest(seq=1, k=2, rows=[Row("r1", 0, [4, 5, 6, 4])]))
    >>> request = msgspec.msgpack.decode(payload, type=StepRequest)
    >>> request.rows[0]
    Row(request_id='r1', position=0, new_token_ids=[4, 5, 6, 4], hidden_start=-1, hidden=b'')
    >>> msgspec.to_builtins(request, builtin_types=(bytes,))["rows"]
    [['r1', 0, [4, 5, 6, 4], -1, b'']]
"""

from __future__ import annotations

import msgspec


class Row(msgspec.Struct, array_like=True):
    """One batch row: the tokens of a request added since the proposer's last call for it."""

    request_id: str
    position: int  # context tokens the proposer believes the service holds
    new_token_ids: list[int]
    # For a drafter over the target's hidden states (`dspark_context`): the hidden states of the
    # tokens at positions hidden_start, hidden_start + 1, ... (the ones the target has run since
    # the last call), `[m, context_width]` as raw `StepRequest.hidden_dtype` bytes, row-major.
    hidden_start: int = -1
    hidden: bytes = b""


class StepStats(msgspec.Struct):
    """The proposer's counters since its last request (the DraftService exports them)."""

    calls: int = 0
    skipped: int = 0  # no call: the previous one is still pending, or no connection yet
    missed: int = 0  # the reply missed the deadline
    rtt_s: list[float] = []
    quiet: int = 0  # rows left out: their request was in an adaptive pause (`StepReply.quiet`)


class StepRequest(msgspec.Struct, kw_only=True):
    """One engine step's batch, proposer -> DraftService."""

    seq: int = 0  # set by the proposer's client as it sends
    k: int  # num_speculative_tokens
    rows: list[Row]
    release: list[str] = []  # request ids that left the batch since the last step
    hidden_dtype: str = "bfloat16"  # of every row's `hidden` (a torch dtype name)
    # The acceptance a draft needs to pay for its verify cost at the engine's current load (the
    # proposer's `StepCost`); None: the service's configured `adaptive.min_acceptance`.
    min_acceptance: float | None = None
    stats: StepStats = msgspec.field(default_factory=StepStats)


class StepReply(msgspec.Struct, kw_only=True):
    """DraftService -> proposer: per row, drafts or where to resend the context from."""

    seq: int
    drafts: list[list[int]] = []  # one per row, maybe empty
    resend_from: list[int] = []  # one per row: -1, or the position to resend from
    # One per row (or none): the next steps its request drafts nothing for (an adaptive pause);
    # the proposer leaves the request out of that many steps and then sends all it skipped.
    quiet: list[int] = []
    error: str | None = None  # the step failed: no drafts, resend every row
    deadline_ms: float | None = None  # the proposer's deadline from now on (the service's say)


class EndpointQuery(msgspec.Struct):
    """Proposer -> the LM replica's resolver: where is the step server of this shard?"""

    stale: str | None = None  # an endpoint that failed: ask Serve for the current one
    # Which of the DraftService's `num_replicas` shards (the requests whose ids hash to it).
    shard: int = 0


class EndpointAnswer(msgspec.Struct):
    """The step server's address and secret, or why there is none (the service is down)."""

    endpoint: str | None = None  # "host:port"
    token: str | None = None
    error: str | None = None
