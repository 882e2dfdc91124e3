"""The encoder-cache store, `moonserve.pipeline.engine.ec_store`: atomic writes, key
checks, least-recently-used eviction (the engines that use it:
tests/engines/test_encoder_cache_app.py).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moonserve.pipeline.engine.ec_store import evict, get, has, put, store_path


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


def test_num_rows_reads_the_header_and_marks_the_entry_used(tmp_path):
    from moonserve.pipeline.engine.ec_store import num_rows

    path = put(tmp_path, "a", torch.zeros(37, 8, dtype=torch.bfloat16))
    os.utime(path, (time.time() - 600, time.time() - 600))
    assert num_rows(tmp_path, "a") == 37
    assert path.stat().st_mtime > time.time() - 60
    with pytest.raises(FileNotFoundError):
        num_rows(tmp_path, "b")


# The LanguageModel's side: entries of images encoded on another node.


def lm_with_store(tmp_path, max_bytes):
    """What `LanguageModel.image_prompt` reads of its replica: the store, the K3 image format and
    the engine's model config."""
    from types import SimpleNamespace

    from moonserve.deployments.language_model import ImageInput
    from moonserve.pipeline.engine.image_format import image_format
    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config

    model_config = SimpleNamespace(model="/models/k3",
                                   multimodal_config=SimpleNamespace(mm_hasher_algorithm="blake3"))
    return SimpleNamespace(images=ImageInput(str(tmp_path / "store"), 4, max_bytes),
                           image_format=image_format(write_k3_config(tmp_path / "k3")),
                           engine=SimpleNamespace(model_config=model_config))


def image_request(key: str, node_id: str = "node-b"):
    from moonserve.pipeline.api.protocol import GenerateRequest, SamplingSpec, StoredEncoding

    return GenerateRequest(f"r-{key}", [1, 9, 9, 2], SamplingSpec(max_tokens=1),
                           image_placeholder_id=9, image_hashes=(key,),
                           encoder_outputs=(StoredEncoding(2, node_id, "/encoder/store"),))


def test_an_lm_stores_what_it_fetches_from_another_node_within_the_bound(tmp_path, monkeypatch):
    from PIL import Image

    from moonserve.deployments.language_model import LanguageModel
    from moonserve.pipeline.engine import ec_store

    fetched = []

    def fetch_from(node_id, store, key):
        fetched.append((node_id, store, key))
        return torch.ones(2, 1024, dtype=torch.bfloat16)  # 4 KB

    monkeypatch.setattr(ec_store, "fetch_from", fetch_from)
    lm = lm_with_store(tmp_path, max_bytes=6000)
    image = Image.new("RGB", (8, 8))
    prompt = LanguageModel.image_prompt(lm, image_request("first"), (image,))
    assert fetched == [("node-b", "/encoder/store", "first")]
    assert prompt["multi_modal_uuids"] == {"image": ["first"]}
    assert prompt["prompt_token_ids"] == [1, 9, 2]
    old = time.time() - 600  # past evict's 60 s grace
    os.utime(store_path(lm.images.store, "first"), (old, old))
    LanguageModel.image_prompt(lm, image_request("second"), (image,))
    assert not has(lm.images.store, "first") and has(lm.images.store, "second")
    LanguageModel.image_prompt(lm, image_request("second"), (image,))  # stored here: no fetch
    assert [key for *_, key in fetched] == ["first", "second"]


def test_an_output_that_cannot_be_fetched_is_left_to_the_engine(tmp_path, monkeypatch):
    from PIL import Image

    from moonserve.deployments.language_model import LanguageModel
    from moonserve.pipeline.engine import ec_store

    def fetch_from(node_id, store, key):
        raise FileNotFoundError(key)  # evicted on the encoder's node meanwhile

    monkeypatch.setattr(ec_store, "fetch_from", fetch_from)
    lm = lm_with_store(tmp_path, max_bytes=None)
    prompt = LanguageModel.image_prompt(lm, image_request("gone"), (Image.new("RGB", (8, 8)),))
    assert prompt["multi_modal_uuids"] == {"image": ["gone"]} and not has(lm.images.store, "gone")


def test_the_store_loads_no_vllm_and_its_example_runs():
    """A Ray task that fetches an entry on another node imports this module: it must not load
    vLLM (seconds per new worker process)."""
    import subprocess
    import sys

    code = ("import sys, doctest, moonserve.pipeline.engine.ec_store as m; "
            "assert doctest.testmod(m).failed == 0; print('vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
