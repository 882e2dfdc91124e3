"""How a model that vLLM serves as multimodal takes an image: its modality, item and prompt text.

With `vision.handover: encoder_cache` images reach vLLM as multimodal inputs, each with its key
(the image's SHA-256) as its `multi_modal_uuids` entry, so an `ec_consumer` engine finds the
encoder output the VisionEncoder stored under that key. The prompt text of one image is what the
model class's `get_placeholder_str("image", i)` returns, read without importing vLLM's model
classes (the Router runs this, on nodes that may have no GPU): Kimi K3's from the checkpoint's
`image_placeholder` (the text vLLM's K3 processor replaces), Kimi K2.5's fixed text
(tests/unit/test_image_format.py asks both classes); vLLM's processor then expands it to the
model's full format (Kimi K2.5: its placeholder text's one `<|media_pad|>`
becomes one per image token; Kimi K3: its one-token placeholder becomes
`<|media_begin|>image {w}x{h}<|media_content|>`, the pads and `<|media_end|>`).

API (all that other modules should use):

- `image_format(model_path) -> ImageFormat`: the format of the checkpoint's architecture
  (config.json `architectures[0]`); ValueError for an architecture not in `MODALITIES`.
- `ImageFormat.placeholder_text`: one image in the prompt, before vLLM expands it.
- `ImageFormat.multi_modal(images, keys) -> dict`: the `multi_modal_data` and `multi_modal_uuids`
  entries of a vLLM prompt for PIL `images` under `keys`, in prompt order.
- `ImageFormat.wrapper(width, height) -> (before, after)`: the text vLLM's processor writes around
  an image's pads in place of the placeholder ("", "" when the placeholder text already holds it),
  so the router counts an image as the engine will: its pads plus the wrapper's tokens.

Example:
    >>> fmt = ImageFormat("KimiK25ForConditionalGeneration", "vision_chunk", "<|media_pad|>", True)
    >>> fmt.multi_modal(["<PIL image>"], ["ab12"])["multi_modal_uuids"]
    {'vision_chunk': ['ab12']}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moonserve.pipeline.config import architecture_of

# Architecture -> (the modality its processor takes images under, whether an item is a dict,
# whether the processor writes `<|media_begin|>image {w}x{h}<|media_content|>` ... `<|media_end|>`
# around the pads). Kimi K2.5 takes every medium as a `vision_chunk`: an image is {"type": "image",
# "image": PIL, "uuid": key}, and its placeholder text already holds begin/content/end
# (vllm/model_executor/models/kimi_k25.py); Kimi K3 takes plain PIL images as `image` and replaces
# its one-token placeholder with the whole sequence, sized by the original upload
# (vllm/models/kimi_k3/common/mm_preprocess.py, `_get_prompt_updates`).
MODALITIES = {
    "KimiK25ForConditionalGeneration": ("vision_chunk", True, False),
    "KimiK3ForConditionalGeneration": ("image", False, True),
}
# One image's prompt text where the checkpoint's config does not carry it: K2.5's
# `get_placeholder_str("image", i)` (vllm/model_executor/models/kimi_k25.py). K3's is the config's
# `image_placeholder` (vllm/models/kimi_k3/common/mm_preprocess.py reads it there).
K25_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


@dataclass(frozen=True)
class ImageFormat:
    architecture: str
    modality: str
    placeholder_text: str
    chunk_items: bool  # items are K2.5's {"type": "image", "image": ..., "uuid": ...}
    sized_wrapper: bool = False  # the processor writes K3's sized begin/content/end around pads

    def wrapper(self, width: int, height: int) -> tuple[str, str]:
        if not self.sized_wrapper:
            return "", ""
        return f"<|media_begin|>image {width}x{height}<|media_content|>", "<|media_end|>"

    def store_keys(self, keys: list[str], model_config) -> list[str]:
        """The key each image's encoder output has in the encoder-cache store: the `mm_hash`
        vLLM's engines hand the EC connector for a request `multi_modal` makes from `keys`,
        computed by vLLM's own `ProcessorInputs.get_mm_hashes` with the engine's model id and
        hasher (`model_config`). It is the uuid itself while the request carries no processor
        kwargs; a kwarg that changes vLLM's hash changes this key with it. vLLM hashes a given
        uuid, not the image, so a 1x1 image stands in for each item."""
        from PIL import Image
        from vllm.multimodal.parse import MultiModalDataParser
        from vllm.multimodal.processing.inputs import ProcessorInputs

        prompt = self.multi_modal([Image.new("RGB", (1, 1))] * len(keys), keys)
        items = MultiModalDataParser().parse_mm_data(prompt["multi_modal_data"])
        inputs = ProcessorInputs([], items, prompt["multi_modal_uuids"],
                                 prompt.get("mm_processor_kwargs", {}))
        hashes = inputs.get_mm_hashes(model_config.model,
                                      model_config.multimodal_config.mm_hasher_algorithm)
        return list(hashes[self.modality])

    def multi_modal(self, images: list, keys: list[str]) -> dict:
        items = [{"type": "image", "image": image, "uuid": key} if self.chunk_items else image
                 for image, key in zip(images, keys, strict=True)]
        return {"multi_modal_data": {self.modality: items},
                "multi_modal_uuids": {self.modality: list(keys)}}


def image_format(model_path: str | Path) -> ImageFormat:
    config = json.loads((Path(model_path) / "config.json").read_text())
    architecture = architecture_of(config)
    if architecture not in MODALITIES:
        raise ValueError(f"vision.handover encoder_cache: {model_path} is a {architecture}; "
                         f"the image format is known for {', '.join(MODALITIES)}")
    modality, chunk_items, sized_wrapper = MODALITIES[architecture]
    if architecture == "KimiK25ForConditionalGeneration":
        placeholder = K25_PLACEHOLDER
    elif not config.get("image_placeholder"):
        raise ValueError(f"vision.handover encoder_cache: {model_path}/config.json has no "
                         f"image_placeholder, which vLLM's {architecture} processor replaces")
    else:
        placeholder = config["image_placeholder"]
    return ImageFormat(architecture, modality, placeholder, chunk_items, sized_wrapper)
