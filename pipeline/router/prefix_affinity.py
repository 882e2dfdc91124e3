"""Prefix-cache-aware routing to LanguageModel replicas: Serve's request-router API
(`language_model.routing.policy: prefix_affinity`, set as the LanguageModel deployment's
`RequestRouterConfig`; it runs in every caller of the LanguageModel, i.e. each Router replica).

Each request is keyed by its prompt in blocks of `block_tokens` token ids, chained (a block's key
covers every token before it), with the content hash of each image mixed into the blocks its
placeholder tokens fill, so two prompts that differ only in an image do not share keys. The
router remembers which replica it sent each key to (`AffinityTable`, LRU-bounded, a replica's
keys forgotten when it leaves) and picks, in order:

1. `affinity`: the replicas holding the longest remembered prefix of the request (the least
   loaded of them: a system prompt every replica has seen does not pin new conversations to
   one), unless their queue is more than `imbalance_threshold` requests longer than the
   lightest replica's;
2. `cache_key`: for a request with OpenAI's `prompt_cache_key` (or `user`), the replica that
   rendezvous hashing gives that key, so every Router replica sends a conversation's first turns
   to the same place, under the same load rule;
3. `fallback`: power of two choices (`single` when there is one replica).

The router picks one replica itself and counts the request against it at once. Serve's own
choice is the least loaded of a rank by its queue-length cache, which it counts a request into
only once the request is sent, and which forgets a replica after 10 s without news. Serve
assigns a burst of queued requests in one pass, so every request of the burst saw the same
loads, and a replica this caller had not heard from lately was passed over for one it had: six
streams sent at once to two idle replicas all went to one (seen in CI). Here a replica the
cache has forgotten is asked (Serve's probe) before the choice. The ranks after the first are the
other replicas, least loaded first, so a full replica sends the request on rather than waiting.
Ray Serve LLM's `PrefixCacheAffinityRouter` keys on text only (and asks a shared tree actor with
a blocking call per request); this keeps its load rule and uses token ids, images and a table
local to each caller.

Example (the table alone):
    >>> table = AffinityTable(block_tokens=4, max_keys=1000)
    >>> keys = table.keys(list(range(10)), placeholder_id=None, image_hashes=())   # 2 full blocks
    >>> table.insert(keys, "replica-a")
    >>> table.longest_match(keys, {"replica-a", "replica-b"})
    ({'replica-a'}, 2)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import OrderedDict

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from moonserve.pipeline.api.protocol import GenerateRequest
from moonserve.pipeline.metrics import make_metric

logger = logging.getLogger("moonserve.routing")

DECISIONS = ("affinity", "cache_key", "fallback", "single")
MAX_PENDING = 4096


class AffinityTable:
    """Which replicas each prefix key was sent to; at most `max_keys` keys (least recently used
    go first)."""

    def __init__(self, block_tokens: int, max_keys: int):
        self.block_tokens = block_tokens
        self.max_keys = max_keys
        self.holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def keys(self, token_ids: list[int], placeholder_id: int | None,
             image_hashes: tuple[str, ...] | list[str]) -> list[int]:
        """The chained key of each full block of `token_ids`."""
        size = self.block_tokens
        images = image_runs(token_ids, placeholder_id, image_hashes)
        keys, previous = [], 0
        for start in range(0, len(token_ids) - size + 1, size):
            block = tuple(token_ids[start:start + size])
            inside = tuple(h for first, last, h in images if first < start + size and last > start)
            previous = hash((previous, block, inside))
            keys.append(previous)
        return keys

    def longest_match(self, keys: list[int], replicas: set[str]) -> tuple[set[str], int]:
        """The replicas among `replicas` holding the most leading keys (all of those tied), and
        how many keys they hold."""
        best: set[str] = set()
        depth = 0
        for i, key in enumerate(keys):
            holders = replicas.intersection(self.holders.get(key, ()))
            if not holders:
                break
            best, depth = holders, i + 1
        return best, depth

    def insert(self, keys: list[int], replica: str) -> None:
        for key in keys:
            holders = self.holders.get(key, ())
            if replica not in holders:
                self.holders[key] = holders + (replica,)
            self.holders.move_to_end(key)
        while len(self.holders) > self.max_keys:
            self.holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key, holders in list(self.holders.items()):
            if replica in holders:
                rest = tuple(r for r in holders if r != replica)
                if rest:
                    self.holders[key] = rest
                else:
                    del self.holders[key]


def image_runs(token_ids: list[int], placeholder_id: int | None,
               image_hashes: tuple[str, ...] | list[str]) -> list[tuple[int, int, int]]:
    """(first, end, hash as int) of each image's run of placeholder tokens, in prompt order."""
    if placeholder_id is None or not image_hashes:
        return []
    runs, i, n = [], 0, len(token_ids)
    while i < n and len(runs) < len(image_hashes):
        if token_ids[i] == placeholder_id:
            j = i
            while j < n and token_ids[j] == placeholder_id:
                j += 1
            runs.append((i, j, int(image_hashes[len(runs)][:16], 16)))
            i = j
        else:
            i += 1
    return runs


def rendezvous(key: str, replicas: list[str]) -> str:
    """The replica with the highest hash of (key, replica): the same answer in every process."""
    return max(replicas, key=lambda r: hashlib.blake2b(f"{key}\0{r}".encode(),
                                                       digest_size=8).digest())


def generate_request(pending_request) -> GenerateRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, GenerateRequest) else None


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's request router for the LanguageModel deployment (module docstring)."""

    def initialize_state(self, block_tokens: int = 64, imbalance_threshold: int = 4,
                         max_keys: int = 100_000):
        self.table = AffinityTable(block_tokens, max_keys)
        self.imbalance_threshold = imbalance_threshold
        # request id -> keys, from its first routing attempt until routed (bounded: a request
        # cancelled while being routed never is)
        self.pending_keys: OrderedDict[str, list[int]] = OrderedDict()
        self.decisions = {decision: 0 for decision in DECISIONS}
        self.metric = None
        self.choosing = asyncio.Lock()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = generate_request(pending_request)
        if request is None or len(candidate_replicas) < 2:
            if request is not None:
                self.record("single")
            return await super().choose_replicas(candidate_replicas, pending_request)
        keys = self.pending_keys.get(request.request_id)
        if keys is None:
            keys = self.pending_keys[request.request_id] = self.table.keys(
                request.prompt_token_ids, request.image_placeholder_id, request.image_hashes)
            if len(self.pending_keys) > MAX_PENDING:
                self.pending_keys.popitem(last=False)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        # One choice at a time, each seeing the counts of those before it (module docstring).
        async with self.choosing:
            loads = await self.queue_lengths(candidate_replicas)
            if not loads:  # no replica answered: Serve's own choice, with its backoff
                self.record("fallback")
                return await super().choose_replicas(candidate_replicas, pending_request)
            pick, decision = self.pick(keys, request.cache_key, loads, sorted(by_id))
            self.record(decision)
            # Serve counts the request again once it is sent; the replica's reply to that send
            # sets the true count.
            self.replica_queue_len_cache.update(by_id[pick].replica_id, loads[pick] + 1)
        rest = sorted((rid for rid in by_id if rid != pick),
                      key=lambda rid: loads.get(rid, float("inf")))
        return [[by_id[pick]], [by_id[rid] for rid in rest]]

    def pick(self, keys: list[int], cache_key: str | None, loads: dict[str, int],
             replicas: list[str]) -> tuple[str, str]:
        """The replica for a request, of those whose ongoing requests are in `loads` (the
        others of `replicas` did not answer), and the decision (module docstring)."""
        lightest = min(loads.values())
        chosen, decision = self.table.longest_match(keys, set(loads))[0], "affinity"
        if not chosen and cache_key is not None:
            chosen, decision = {rendezvous(cache_key, replicas)} & loads.keys(), "cache_key"
        if not chosen or min(loads[rid] for rid in chosen) - lightest > self.imbalance_threshold:
            chosen, decision = random.sample(sorted(loads), min(2, len(loads))), "fallback"
        return min(chosen, key=lambda rid: (loads[rid], random.random())), decision

    async def queue_lengths(self, replicas) -> dict[str, int]:
        """Each replica's ongoing requests as this caller knows them (Serve's cache, which every
        send and every reply updates); a replica the cache has forgotten is asked (Serve's
        probe), and one that does not answer in time is left out."""
        cache = self.replica_queue_len_cache
        known = {r.replica_id.to_full_id_str(): cache.get(r.replica_id) for r in replicas}
        forgotten = [r for r in replicas if known[r.replica_id.to_full_id_str()] is None]
        for replica, length in await self._probe_queue_lens(forgotten, 0):
            known[replica.replica_id.to_full_id_str()] = length
        return {rid: n for rid, n in known.items() if n is not None}

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = generate_request(pending_request)
        if request is None:
            return
        keys = self.pending_keys.pop(request.request_id, None)
        if keys is None:
            keys = self.table.keys(request.prompt_token_ids, request.image_placeholder_id,
                                   request.image_hashes)
        self.table.insert(keys, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self.table.forget(gone.to_full_id_str())

    def record(self, decision: str) -> None:
        """Count a decision, also as the Ray metric `moonserve_lm_routing_decisions`."""
        self.decisions[decision] += 1
        if self.metric is None:
            self.metric = make_metric("moonserve_lm_routing_decisions")
        self.metric.inc(tags={"decision": decision})
