"""Image placeholders in the prompt, expanded at the router.

The chat template carries one placeholder token per image; the router expands each to one
position per image token (so prompt length, context checks, lanes and `usage.prompt_tokens` count
image tokens). The LanguageModel later writes the encoder's embeddings of image i over run i
(`moonserve.pipeline.engine.splice`).

With `vision.handover: encoder_cache` the LanguageModel collapses each run back to one token
before the engine (vLLM's processor expands it again, by its own count).

Example:
    >>> expand_placeholders([1, 9, 2, 9, 3], placeholder_id=9, counts=[2, 3])
    [1, 9, 9, 2, 9, 9, 9, 3]
    >>> collapse_placeholders([1, 9, 9, 2, 9, 9, 9, 3], placeholder_id=9)
    [1, 9, 2, 9, 3]
"""

from __future__ import annotations


def expand_placeholders(ids: list[int], placeholder_id: int, counts: list[int]) -> list[int]:
    """Replace the i-th placeholder with `counts[i]` copies of it."""
    found = sum(1 for t in ids if t == placeholder_id)
    if found != len(counts):
        raise ValueError(f"the prompt has {found} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    images = iter(counts)
    for t in ids:
        out.extend([t] * next(images) if t == placeholder_id else [t])
    return out


def collapse_placeholders(ids: list[int], placeholder_id: int) -> list[int]:
    """Replace every run of `placeholder_id` with one copy (the inverse of `expand_placeholders`
    where runs are separated, as each image's placeholder text separates them)."""
    return [t for i, t in enumerate(ids)
            if t != placeholder_id or i == 0 or ids[i - 1] != placeholder_id]
