"""`moonserve.pipeline.engine.image_format`: how an image goes to a model vLLM serves as
multimodal, asked of vLLM's own model classes."""

from __future__ import annotations

import json

import pytest

from moonserve.pipeline.engine.image_format import MODALITIES, image_format


def write_config(directory, architecture: str):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return directory


def test_kimi_k25_takes_vision_chunks_with_its_own_placeholder_text(tmp_path):
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    fmt = image_format(write_config(tmp_path / "k25", "KimiK25ForConditionalGeneration"))
    assert fmt.placeholder_text == KimiK25ForConditionalGeneration.get_placeholder_str("image", 0)
    assert fmt.placeholder_text.count("<|media_pad|>") == 1
    mm = fmt.multi_modal(["pil-a", "pil-b"], ["key-a", "key-b"])
    assert mm["multi_modal_data"] == {"vision_chunk": [
        {"type": "image", "image": "pil-a", "uuid": "key-a"},
        {"type": "image", "image": "pil-b", "uuid": "key-b"}]}
    assert mm["multi_modal_uuids"] == {"vision_chunk": ["key-a", "key-b"]}


def test_kimi_k3_takes_plain_images(tmp_path):
    fmt = image_format(write_config(tmp_path / "k3", "KimiK3ForConditionalGeneration"))
    assert fmt.multi_modal(["pil"], ["key"]) == {"multi_modal_data": {"image": ["pil"]},
                                                 "multi_modal_uuids": {"image": ["key"]}}
    with pytest.raises(ValueError):
        fmt.multi_modal(["pil"], [])  # every image needs its key


def test_an_architecture_without_a_known_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a LlamaForCausalLM; the image format is known for "
                                         + ", ".join(MODALITIES)):
        image_format(write_config(tmp_path / "llama", "LlamaForCausalLM"))
