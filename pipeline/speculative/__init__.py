"""Speculative decoding without Ray: draft proposers and the DraftService's per-request state.

- `drafter`: the `Drafter` / `DrafterState` protocols every drafter implements.
- `ngram`: model-free prompt-lookup drafter matching vLLM's in-engine `ngram` method.
- `sessions`: `DraftSessions`, the bounded per-request context store behind the DraftService.
"""
