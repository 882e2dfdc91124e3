"""Placeholder expansion, embedding splice and the encoder cache (pure, no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moonserve.pipeline.api.placeholders import collapse_placeholders, expand_placeholders
from moonserve.pipeline.engine.splice import placeholder_runs, splice_image_embeddings
from moonserve.pipeline.vision.cache import EmbeddingCache

P = 7


def test_expand_gives_each_image_its_run_in_order():
    assert expand_placeholders([1, P, 2, P, 3], P, [2, 3]) == [1, P, P, 2, P, P, P, 3]
    assert expand_placeholders([1, 2], P, []) == [1, 2]


@pytest.mark.parametrize("ids, counts", [([1, P, 2, P, 3], [2, 3]), ([P, 5, P], [1, 4]),
                                         ([P], [9]), ([1, 2], [])])
def test_collapse_undoes_expand_when_runs_are_separated(ids, counts):
    expanded = expand_placeholders(ids, P, counts)
    assert collapse_placeholders(expanded, P) == ids
    assert collapse_placeholders(ids, P) == ids  # nothing to collapse


def test_image_fan_in_needs_the_placeholder_once_in_the_image_text():
    from moonserve.pipeline.router.fan_in import ImageFanIn

    text = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    fan_in = ImageFanIn("<|media_pad|>", None, None, text, engine_cache=True)
    assert (fan_in.placeholder, fan_in.text, fan_in.engine_cache) == ("<|media_pad|>", text, True)
    assert ImageFanIn("<empty_output>", None, None).text == "<empty_output>"
    for wrong in ("<|media_begin|>image<|media_end|>", "<|media_pad|><|media_pad|>"):
        with pytest.raises(ValueError, match="must occur once"):
            ImageFanIn("<|media_pad|>", None, None, wrong)


def test_decoded_only_preprocessing_counts_as_the_full_preprocessing():
    import io

    from PIL import Image

    from moonserve.deployments.preprocess import decode_and_count, decode_and_patchify
    from moonserve.pipeline.vision.preprocess_config import PreprocessConfig

    cfg = PreprocessConfig(in_patch_limit=1024, patch_limit_on_one_side=64)
    for size in [(64, 48), (40, 70), (1000, 17), (3000, 2000)]:
        out = io.BytesIO()
        Image.new("RGB", size, (10, 200, 30)).save(out, format="PNG")
        image, grid_thw, num_tokens = decode_and_count(out.getvalue(), cfg)
        pixels, full = decode_and_patchify(out.getvalue(), cfg)
        assert (image.mode, image.size) == ("RGB", size)
        assert (tuple(grid_thw), num_tokens) == (tuple(full.grid_thw), full.num_image_tokens)
        assert pixels.shape[0] == grid_thw[1] * grid_thw[2]


@pytest.mark.parametrize("ids, counts", [([1, P, P, 2], [4]), ([1, 2], [3]), ([P], [1, 1])])
def test_expand_refuses_a_placeholder_count_that_is_not_the_image_count(ids, counts):
    with pytest.raises(ValueError, match="image placeholder"):
        expand_placeholders(ids, P, counts)


def test_splice_writes_each_image_over_its_run_and_keeps_text_rows():
    ids = torch.tensor(expand_placeholders([1, P, 2, P, 3], P, [2, 3]))
    tokens = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(len(ids), 4)
    images = [torch.full((2, 4), -1.0), torch.full((3, 4), -2.0)]
    out = splice_image_embeddings(tokens, ids, P, images)
    assert placeholder_runs(ids, P) == [(1, 2), (4, 3)]
    assert torch.equal(out[1:3], images[0]) and torch.equal(out[4:7], images[1])
    text = torch.tensor([0, 3, 7])
    assert torch.equal(out[text], tokens[text])
    assert torch.equal(tokens[1], torch.arange(4, 8, dtype=torch.float32)), "input not modified"


@pytest.mark.parametrize("images, needle", [
    ([torch.zeros(2, 4)], "placeholder runs"),
    ([torch.zeros(2, 4), torch.zeros(3, 5)], "hidden size 5"),
])
def test_splice_refuses_mismatched_images(images, needle):
    ids = torch.tensor(expand_placeholders([1, P, 2, P, 3], P, [2, 3]))
    with pytest.raises(ValueError, match=needle):
        splice_image_embeddings(torch.zeros(len(ids), 4), ids, P, images)


def test_cache_is_lru_and_bounded_by_bytes():
    a, b, c = (np.zeros((10, 10), np.float32) for _ in range(3))  # 400 bytes each
    cache = EmbeddingCache(max_bytes=1000)
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now the most recent
    cache.put("c", c)           # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("c") is c
    assert cache.bytes == 800 and cache.stats()["entries"] == 2
    cache.put("huge", np.zeros(1000, np.float32))  # larger than the cache: not kept
    assert cache.get("huge") is None and cache.bytes == 800
    assert (cache.hits, cache.misses) == (2, 2)


def test_cache_replaces_a_key_in_place_and_drops_it_for_a_value_too_large():
    cache = EmbeddingCache(max_bytes=1000)
    cache.put("a", np.zeros(100, np.float32))  # 400 bytes
    cache.put("a", np.zeros(200, np.float32))  # 800 bytes: replaces, no double count
    assert cache.bytes == 800 and cache.stats()["entries"] == 1
    cache.put("a", np.zeros(1000, np.float32))  # too large: not kept, and the old value is gone
    assert cache.get("a") is None and cache.bytes == 0
