"""The embedding splice at the LanguageModel: image i's encoder rows over placeholder run i.

The router has expanded each image's placeholder to one position per image token
(`moonserve.pipeline.api.placeholders`); here the run of positions of image i in the token
embeddings `[seq, hidden]` is replaced with the encoder's embeddings of image i, and the result goes
to vLLM as `prompt_embeds`.

Example:
    >>> import torch
    >>> placeholder_runs(torch.tensor([1, 9, 9, 2, 9, 9, 9, 3]), placeholder_id=9)
    [(1, 2), (4, 3)]
"""

from __future__ import annotations

import torch


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
