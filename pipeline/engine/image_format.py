"""How a model that vLLM serves as multimodal takes an image: its modality, item and prompt text.

With `vision.handover: encoder_cache` images reach vLLM as multimodal inputs, each with its key
(the image's SHA-256) as its `multi_modal_uuids` entry, so an `ec_consumer` engine finds the
encoder output the VisionEncoder stored under that key. The prompt text of one image is the model
class's own `get_placeholder_str("image", i)`, asked of vLLM's model registry; vLLM's processor
then expands it to the model's full format (Kimi K2.5: its placeholder text's one `<|media_pad|>`
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

    def multi_modal(self, images: list, keys: list[str]) -> dict:
        items = [{"type": "image", "image": image, "uuid": key} if self.chunk_items else image
                 for image, key in zip(images, keys, strict=True)]
        return {"multi_modal_data": {self.modality: items},
                "multi_modal_uuids": {self.modality: list(keys)}}


def image_format(model_path: str | Path) -> ImageFormat:
    config = json.loads((Path(model_path) / "config.json").read_text())
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in MODALITIES:
        raise ValueError(f"vision.handover encoder_cache: {model_path} is a {architecture}; "
                         f"the image format is known for {', '.join(MODALITIES)}")
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls = ModelRegistry._try_load_model_cls(architecture)
    if model_cls is None:
        raise ValueError(f"vision.handover encoder_cache: this vLLM has no {architecture}")
    modality, chunk_items, sized_wrapper = MODALITIES[architecture]
    return ImageFormat(architecture, modality, model_cls.get_placeholder_str("image", 1),
                       chunk_items, sized_wrapper)
