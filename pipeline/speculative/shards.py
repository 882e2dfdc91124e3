"""Sharding the DraftService's sessions over its replicas, by request id.

With `draft.deployment.num_replicas: N` above 1, each request's draft context lives in one of N
shards, `shard_of(request_id, N)`; the LM replica's proposer sends each step's rows to the shards
they hash to, one message per shard, all in flight together under the one deadline
(`moonserve.pipeline.engine.proposer.ShardedDraftClient`). A proposer finds a shard's step server
through its LM replica's resolver, which asks Serve `endpoint(shard)`; `ShardRouter`
(`moonserve.pipeline.router.draft_shards`), the DraftService's request router, sends that call
to the shard's replica: the shard's index in the running replicas sorted by id, modulo their
number. So every LM replica reaches the same replica for a request, and while a replica is
down its shard goes to another (whose sessions then start from the context the proposer
resends); the resolvers ask again every `REFRESH_S`, so a shard goes home once its replica is
back.

Example:
    >>> shard_of("chatcmpl-1f2e", 4)
    2
"""

from __future__ import annotations

import hashlib

# How often a sharded proposer (and its resolver) asks again where its shard lives.
REFRESH_S = 10.0


def shard_of(request_id: str, shards: int) -> int:
    """The shard of a request: the same in every process."""
    if shards == 1:
        return 0
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def requested_shard(pending_request) -> int | None:
    """The shard a DraftService call names (`endpoint(shard)`, `set_drafter(..., shard=i)`),
    else None."""
    if pending_request is None:
        return None
    shard = pending_request.kwargs.get("shard")
    if shard is None and pending_request.args and \
            pending_request.metadata.call_method == "endpoint":
        shard = pending_request.args[0]
    return shard if isinstance(shard, int) and not isinstance(shard, bool) else None
