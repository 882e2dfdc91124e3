"""Speculative decoding, the DraftService side (docs/speculative.md).

- `endpoint`: the DraftService's step server and the LM replica's endpoint resolver.
- `wire`: the step message schemas (msgspec structs).
- `service`: `DraftCore`, what the DraftService does with a step (sessions, prefetch).
- `sessions`: `DraftSessions`, the bounded per-request context store.
- `drafter`: the `Drafter` / `DrafterState` protocols; `ngram` and `dspark` implement them.

vLLM's side, `ServiceProposer`, is `moonserve.pipeline.engine.proposer`; the offline acceptance
measurement is `moonserve.pipeline.bench.acceptance`.
"""
