"""The encoder-cache store of `moonserve.pipeline.engine.ec_connector`: atomic writes, key
checks, least-recently-used eviction (the engines that use it: tests/engines/test_ec_connector.py).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moonserve.pipeline.engine.ec_connector import evict, get, has, put, store_path


def test_put_is_atomic_and_get_returns_the_tensor(tmp_path):
    tensor = torch.randn(9, 256).to(torch.bfloat16)
    path = put(tmp_path, "a", tensor)
    assert path == store_path(tmp_path, "a") and has(tmp_path, "a") and not has(tmp_path, "b")
    assert torch.equal(get(tmp_path, "a"), tensor)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    with pytest.raises(FileNotFoundError):
        get(tmp_path, "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("key", ["", ".", "..", "a/b", "../x"])
def test_keys_must_be_one_file_name(tmp_path, key):
    with pytest.raises(ValueError, match="not a valid file name"):
        store_path(tmp_path, key)


def test_evict_drops_least_recently_used_first(tmp_path):
    for i, key in enumerate(["old", "mid", "new"]):
        path = put(tmp_path, key, torch.zeros(64, 64))  # 16 KiB + header each
        past = time.time() - 1000 + i
        os.utime(path, (past, past))
    get(tmp_path, "old")  # a read makes it the most recently used
    size = store_path(tmp_path, "mid").stat().st_size
    assert evict(tmp_path, max_bytes=2 * size, keep_newer_than_s=0) == ["mid"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]
    assert evict(tmp_path, max_bytes=0) == ["new"]  # "old" was used within keep_newer_than_s
