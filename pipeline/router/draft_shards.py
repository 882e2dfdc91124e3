"""`ShardRouter`: Serve's request router for a DraftService with several replicas
(`draft.deployment.num_replicas` above 1): a call that names a shard (`endpoint(shard)`) goes to
that shard's replica, the shard's index in the running replicas sorted by id, modulo their number
(`moonserve.pipeline.speculative.shards` has the whole scheme). Calls naming no shard go by
Serve's power of two choices.
"""

from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from moonserve.pipeline.speculative.shards import requested_shard


class ShardRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's request router for a sharded DraftService (module docstring)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        shard = requested_shard(pending_request)
        if shard is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.to_full_id_str())
        return [[ordered[shard % len(ordered)]]]
