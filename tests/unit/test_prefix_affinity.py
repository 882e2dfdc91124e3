"""The prefix-affinity request router: its key table, and the router itself over Ray Serve's own
in-memory replica stand-ins (`ray.serve._private.test_utils.FakeRunningReplica`, the one Serve's
router tests use), called the way Serve calls a request router."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.test_utils import FakeRunningReplica

from moonserve.pipeline.api.protocol import GenerateRequest, SamplingSpec
from moonserve.pipeline.router.prefix_affinity import (
    AffinityTable,
    PrefixAffinityRouter,
    rendezvous,
)

PAD = 7  # the image placeholder token in these prompts
SYSTEM = list(range(100, 116))  # 4 blocks of 4


def table(max_keys: int = 1000) -> AffinityTable:
    return AffinityTable(block_tokens=4, max_keys=max_keys)


def test_keys_cover_full_blocks_and_chain_the_prefix():
    t = table()
    keys = t.keys(SYSTEM + [1, 2, 3, 4, 5], None, ())
    assert len(keys) == 5  # the trailing partial block has no key
    assert t.keys(SYSTEM + [1, 2, 3, 4, 9], None, ()) == keys
    other = t.keys(SYSTEM[:4] + [0] + SYSTEM[5:] + [1, 2, 3, 4], None, ())
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))


def test_images_enter_the_keys_of_the_blocks_they_fill():
    t = table()
    prompt = SYSTEM + [PAD] * 6 + [1, 2]  # the image fills blocks 4 and 5
    cat, dog = "a" * 64, "b" * 64
    with_cat = t.keys(prompt, PAD, (cat,))
    with_dog = t.keys(prompt, PAD, (dog,))
    assert with_cat[:4] == with_dog[:4] and with_cat[4] != with_dog[4]
    assert t.keys(prompt, PAD, (cat,)) == with_cat
    assert t.keys(prompt, None, ()) != with_cat  # text-only keys do not collide with the image


def test_longest_match_among_live_replicas_lru_bound_and_forget():
    t = table(max_keys=6)
    short, long = t.keys(SYSTEM, None, ()), t.keys(SYSTEM + [1, 2, 3, 4], None, ())
    t.insert(short, "a")
    t.insert(long, "b")
    assert t.longest_match(long, {"a", "b"}) == ({"b"}, 5)
    assert t.longest_match(short, {"a", "b"}) == ({"a", "b"}, 4)  # both hold the shared blocks
    assert t.longest_match(long, {"a"}) == ({"a"}, 4)
    assert t.longest_match(long, {"c"}) == (set(), 0)
    t.insert(t.keys([9] * 8, None, ()), "a")  # 2 more keys: the 6-key bound drops the oldest
    assert len(t.holders) == 6 and t.longest_match(long, {"a", "b"}) == (set(), 0)
    t.forget("a")
    assert all(h == ("b",) for h in t.holders.values())


def test_rendezvous_is_stable_and_spreads_keys():
    replicas = ["r1", "r2", "r3"]
    assert rendezvous("conversation-7", replicas) == rendezvous("conversation-7",
                                                                list(reversed(replicas)))
    homes = [rendezvous(f"conversation-{i}", replicas) for i in range(300)]
    assert all(60 < homes.count(r) < 140 for r in replicas)


def make_router(*replicas: FakeRunningReplica, threshold: int = 4) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DeploymentID(name="LanguageModel"),
                                  handle_source=DeploymentHandleSource.UNKNOWN,
                                  use_replica_queue_len_cache=True)
    router.initialize_state(block_tokens=4, imbalance_threshold=threshold, max_keys=1000)
    router.update_replicas(list(replicas))
    return router


def idle(*names: str) -> list[FakeRunningReplica]:
    """Replicas that answer Serve's queue-length probe with 0."""
    replicas = [FakeRunningReplica(name) for name in names]
    for r in replicas:
        r.set_queue_len_response(0)
    return replicas


def set_loads(router: PrefixAffinityRouter, **loads: int) -> None:
    """What the caller's queue-length cache says of each replica (by name)."""
    for replica in router._replicas.values():
        router.replica_queue_len_cache.update(replica.replica_id, loads[replica.replica_id.unique_id])


def pending(prompt: list[int], request_id: str, cache_key: str | None = None) -> PendingRequest:
    request = GenerateRequest(request_id, prompt, SamplingSpec(8), cache_key=cache_key)
    return PendingRequest(args=[request, ("127.0.0.1", 1)], kwargs={},
                          metadata=RequestMetadata(request_id=request_id,
                                                   internal_request_id=request_id))


def names(rank) -> list[str]:
    return [r.replica_id.unique_id for r in rank]


async def test_a_conversation_follows_its_prefix_until_that_replica_is_loaded():
    r1, r2 = idle("r1", "r2")
    router = make_router(r1, r2)
    turn1 = SYSTEM + [1, 2, 3, 4]
    ranks = await router.choose_replicas([r1, r2], pending(turn1, "t1"))
    # Nothing known: power of two choices, one replica first, the other after it.
    assert sorted(names(ranks[0]) + names(ranks[1])) == ["r1", "r2"] and len(ranks[0]) == 1
    assert router.decisions["fallback"] == 1
    router.on_request_routed(pending(turn1, "t1"), r2.replica_id, None)
    set_loads(router, r1=0, r2=0)
    turn2 = turn1 + [5, 6, 7, 8, 9]
    ranks = await router.choose_replicas([r1, r2], pending(turn2, "t2"))
    assert names(ranks[0]) == ["r2"] and names(ranks[1]) == ["r1"]
    assert router.decisions["affinity"] == 1
    # Counted against r2 at once, before Serve sends it.
    assert router.replica_queue_len_cache.get(r2.replica_id) == 1
    # r2 is 5 requests deeper than r1 (threshold 4): load wins.
    set_loads(router, r1=0, r2=5)
    assert names((await router.choose_replicas([r1, r2], pending(turn2, "t3")))[0]) == ["r1"]
    assert router.decisions["fallback"] == 2
    set_loads(router, r1=0, r2=4)
    assert names((await router.choose_replicas([r1, r2], pending(turn2, "t4")))[0]) == ["r2"]


async def test_a_prefix_both_replicas_hold_goes_to_the_less_loaded():
    r1, r2 = idle("r1", "r2")
    router = make_router(r1, r2)
    router.on_request_routed(pending(SYSTEM + [1, 2, 3, 4], "a"), r1.replica_id, None)
    router.on_request_routed(pending(SYSTEM + [5, 6, 7, 8], "b"), r2.replica_id, None)
    for loads, lighter in (({"r1": 2, "r2": 1}, "r2"), ({"r1": 0, "r2": 1}, "r1")):
        set_loads(router, **loads)
        new = await router.choose_replicas([r1, r2], pending(SYSTEM + [9, 9, 9, 9], "c"))
        assert names(new[0]) == [lighter]
    assert router.decisions["affinity"] == 2


async def test_a_burst_spreads_over_idle_replicas_whatever_the_cache_remembers():
    """Serve assigns a burst of queued requests in one pass. r1 was heard from lately (its
    queue length is cached), r2's entry has expired: Serve's own choice sends all six to r1
    (seen in CI); here r2 is asked first and each request counts against its replica at once."""
    r1, r2 = idle("r1", "r2")
    router = make_router(r1, r2)
    router.replica_queue_len_cache.update(r1.replica_id, 0)
    picks = await asyncio.gather(*(router._choose_replica_for_request(pending([k] * 3, f"q{k}"))
                                   for k in range(6)))
    assert sorted(p.replica_id.unique_id for p in picks) == ["r1"] * 3 + ["r2"] * 3


async def test_a_replica_that_does_not_answer_is_passed_over():
    r1, r2 = idle("r1", "r2")
    r2.set_queue_len_response(0, exception=RuntimeError("replica busy"))
    router = make_router(r1, r2)
    for k in range(3):
        ranks = await router.choose_replicas([r1, r2], pending([k] * 3, f"q{k}"))
        assert names(ranks[0]) == ["r1"] and names(ranks[1]) == ["r2"]
    r1.set_queue_len_response(0, exception=RuntimeError("replica busy"))
    router.replica_queue_len_cache.invalidate_key(r1.replica_id)
    ranks = await router.choose_replicas([r1, r2], pending([9] * 3, "q9"))
    assert sorted(names(ranks[0])) == ["r1", "r2"]  # no answer at all: Serve's own choice


async def test_other_methods_and_one_replica_use_serves_choice():
    r1, r2 = idle("r1", "r2")
    router = make_router(r1, r2)
    health = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("h", "h"))
    assert len((await router.choose_replicas([r1, r2], health))[0]) == 2
    alone = make_router(r1)
    assert names((await alone.choose_replicas([r1], pending(SYSTEM, "x")))[0]) == ["r1"]
    assert sum(router.decisions.values()) == 0 and alone.decisions["single"] == 1


async def test_a_cache_key_sends_first_turns_to_the_same_replica_from_every_router():
    replicas = idle("r0", "r1", "r2")
    routers = [make_router(*replicas), make_router(*reversed(replicas))]
    for k in range(10):
        request = pending([k] * 8, f"q{k}", cache_key=f"conversation-{k}")
        picks = set()
        for router in routers:
            set_loads(router, r0=0, r1=0, r2=0)
            picks.add(tuple(names((await router.choose_replicas(replicas, request))[0])))
        assert len(picks) == 1 and len(picks.pop()) == 1
    assert all(r.decisions["cache_key"] == 10 for r in routers)


async def test_a_replica_that_leaves_takes_its_affinity_with_it():
    r1, r2 = idle("r1", "r2")
    router = make_router(r1, r2)
    router.on_request_routed(pending(SYSTEM, "a"), r1.replica_id, None)
    assert names((await router.choose_replicas([r1, r2], pending(SYSTEM, "b")))[0]) == ["r1"]
    router.update_replicas([r2])
    assert router.table.holders == {}
    router.on_request_routed(pending(SYSTEM, "c"), r2.replica_id, None)
    router.on_replica_actor_died(r2.replica_id)
    assert router.table.holders == {}
