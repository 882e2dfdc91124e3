"""Image placeholders in the prompt: expansion at the router, embedding splice at the LM.

The chat template carries one placeholder token per image; the router expands each to one
position per image token (so prompt length, context checks, lanes and `usage.prompt_tokens` count
image tokens), and the LanguageModel replaces the run of positions of image i with the encoder's
embeddings of image i.

Example:
    >>> expand_placeholders([1, 9, 2, 9, 3], placeholder_id=9, counts=[2, 3])
    [1, 9, 9, 2, 9, 9, 9, 3]
"""

from __future__ import annotations

import torch


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


def placeholder_runs(ids: torch.Tensor, placeholder_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of the placeholder in `ids` [seq]."""
    mask = ids == placeholder_id
    if not bool(mask.any()):
        return []
    edges = torch.diff(mask.int(), prepend=torch.zeros(1, dtype=torch.int32),
                       append=torch.zeros(1, dtype=torch.int32))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [(s, e - s) for s, e in zip(starts, ends)]


def splice_image_embeddings(token_embeds: torch.Tensor, ids: torch.Tensor, placeholder_id: int,
                            images: list[torch.Tensor]) -> torch.Tensor:
    """token_embeds [seq, hidden] with image i's rows [n_i, hidden] written over run i.

    Adjacent images must be separated by at least one other token (the template guarantees it),
    so each run is exactly one image.
    """
    runs = placeholder_runs(ids, placeholder_id)
    if [n for _, n in runs] != [img.shape[0] for img in images]:
        raise ValueError(f"placeholder runs {[n for _, n in runs]} do not match the image "
                         f"embeddings {[img.shape[0] for img in images]}")
    out = token_embeds.clone()
    for (start, n), image in zip(runs, images):
        if image.shape[1] != out.shape[1]:
            raise ValueError(f"image embeddings have hidden size {image.shape[1]}, the language "
                             f"model {out.shape[1]}")
        out[start:start + n] = image.to(out.dtype)
    return out
