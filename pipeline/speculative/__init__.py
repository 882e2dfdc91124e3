"""Speculative decoding through the DraftService (README "Speculative decoding").

- `proposer`: `ServiceProposer`, vLLM's `custom_class` proposer, run in the engine's workers.
- `endpoint`: the DraftService's step server and the LM replica's endpoint resolver.
- `wire`: the step message format.
- `service`: `DraftCore`, what the DraftService does with a step (sessions, prefetch).
- `sessions`: `DraftSessions`, the bounded per-request context store.
- `drafter`: the `Drafter` / `DrafterState` protocols; `ngram` and `dspark` implement them.
- `acceptance`: offline acceptance of a drafter against target continuations.
"""
