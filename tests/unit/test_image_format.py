"""`moonserve.pipeline.engine.image_format`: how an image goes to a model vLLM serves as
multimodal, asked of vLLM's own model classes and processor; the format itself never imports a
model class (the Router builds it)."""

from __future__ import annotations

import json

import pytest

from moonserve.pipeline.engine.image_format import MODALITIES, image_format


def write_config(directory, architecture: str, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture],
                                                       **fields}))
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


def test_kimi_k3_takes_plain_images_under_its_configs_placeholder(tmp_path):
    from vllm.models.kimi_k3.amd.model import KimiK3ForConditionalGeneration as AMD
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration as NVIDIA

    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config

    fmt = image_format(write_k3_config(tmp_path / "k3"))
    assert fmt.placeholder_text == AMD.get_placeholder_str("image", 0) \
        == NVIDIA.get_placeholder_str("image", 0)
    with pytest.raises(ValueError, match="config.json has no image_placeholder"):
        image_format(write_config(tmp_path / "bare", "KimiK3ForConditionalGeneration"))
    assert fmt.multi_modal(["pil"], ["key"]) == {"multi_modal_data": {"image": ["pil"]},
                                                 "multi_modal_uuids": {"image": ["key"]}}
    with pytest.raises(ValueError):
        fmt.multi_modal(["pil"], [])  # every image needs its key


def test_the_format_is_read_without_importing_vllms_model_classes(tmp_path):
    import subprocess
    import sys

    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config

    checkpoint = write_k3_config(tmp_path / "k3")
    code = ("import sys; from moonserve.pipeline.engine.image_format import image_format; "
            f"image_format({str(checkpoint)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm.model', 'vllm.models', "
            "'torch'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_an_architecture_without_a_known_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a LlamaForCausalLM; the image format is known for "
                                         + ", ".join(MODALITIES)):
        image_format(write_config(tmp_path / "llama", "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def k3_processor(tmp_path_factory):
    """vLLM's own multimodal processor of a synthetic K3 checkpoint (config, preprocessor config
    and tokenizer; no weights)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config

    checkpoint = write_k3_config(tmp_path_factory.mktemp("models") / "k3")
    config = ModelConfig(model=str(checkpoint), trust_remote_code=True,
                         limit_mm_per_prompt={"image": 1})
    return checkpoint, MULTIMODAL_REGISTRY.create_processor(config)


@pytest.mark.parametrize("size", [(64, 48), (1000, 17), (300, 301), (2000, 1500)])
def test_the_router_counts_a_k3_image_as_vllms_processor_expands_it(k3_processor, size):
    """The positions the router gives an image (its pads from the preprocessor's layout, plus
    the tokens of K3's sized wrapper) are the tokens vLLM's K3 processor puts in its place."""
    import io

    from PIL import Image

    from moonserve.deployments.preprocess import decode_and_count
    from moonserve.deployments.router import image_fan_in
    from moonserve.pipeline.api.prompt import PromptBuilder
    from moonserve.pipeline.api.protocol import ImageInfo
    from moonserve.pipeline.config import VisionConfig
    from moonserve.pipeline.vision.preprocess_config import PreprocessConfig

    checkpoint, processor = k3_processor
    media = json.loads((checkpoint / "preprocessor_config.json").read_text())["media_proc_cfg"]
    cfg = PreprocessConfig(patch_size=media["patch_size"],
                           in_patch_limit=media["in_patch_limit"],
                           patch_limit_on_one_side=media["patch_limit_on_one_side"])
    out = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(out, format="PNG")
    image, grid_thw, num_tokens = decode_and_count(out.getvalue(), cfg)
    info = ImageInfo("key", tuple(grid_thw), num_tokens, image.size, None)
    vision = VisionConfig(handover="encoder_cache",
                          image_placeholder="<|kimi_image_placeholder|>")
    tokenizer = PromptBuilder.from_pretrained(str(checkpoint), True).tokenizer
    fan_in = image_fan_in(vision, None, None, str(checkpoint), tokenizer)

    items = processor.info.parse_mm_data({"image": [image]})
    [update] = processor._get_prompt_updates(items, {}, None)
    expanded = update.replacement(0).full  # vLLM's tokens for this image
    assert fan_in.counts([info]) == [len(expanded)]
    assert expanded.count(processor.info.media_token_id) == num_tokens


@pytest.mark.parametrize("writer", ["k3", "k25"])
def test_store_keys_are_vllms_hashes_of_what_multi_modal_sends(tmp_path, monkeypatch, writer):
    """The encoder-cache key is vLLM's own hash of the request's items (the mm_hash its engines
    hand the EC connector): the uuid itself for the requests moonserve sends, and a request
    kwarg that changes vLLM's hash changes the key with it."""
    from types import SimpleNamespace

    from moonserve.pipeline.engine import image_format as module
    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config
    from vllm.multimodal.hasher import MultiModalHasher

    checkpoint = write_k3_config(tmp_path / "k3") if writer == "k3" else \
        write_config(tmp_path / "k25", "KimiK25ForConditionalGeneration")
    fmt = module.image_format(checkpoint)
    config = SimpleNamespace(model=str(checkpoint),
                             multimodal_config=SimpleNamespace(mm_hasher_algorithm="blake3"))
    assert fmt.store_keys(["a" * 64, "b" * 64], config) == ["a" * 64, "b" * 64]
    plain = module.ImageFormat.multi_modal
    monkeypatch.setattr(module.ImageFormat, "multi_modal", lambda self, images, keys: {
        **plain(self, images, keys), "mm_processor_kwargs": {"max_pixels": 1024}})
    [key] = fmt.store_keys(["a" * 64], config)
    assert key == MultiModalHasher.hash_kwargs(
        "blake3", model_id=str(checkpoint), **{fmt.modality: "a" * 64},
        mm_processor_kwargs={"max_pixels": 1024})
