"""The Router's side of the image deployments: every image part preprocessed, then encoded, all
concurrently, while the prompt is tokenized and the request waits for its lane.

Example (`preprocessor` and `encoder` are the ImagePreprocessor and VisionEncoder handles):
    >>> fan_in = ImageFanIn("<empty_output>", preprocessor, encoder)
    >>> images = await fan_in.start([(0, 1, "data:image/png;base64,...")])  # (message, part, url)
    >>> try: refs = await images.embeddings()     # ObjectRefs of [num_image_tokens, hidden]
    ... finally: images.release()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moonserve.pipeline.api.protocol import ImageInfo
from moonserve.pipeline.router.failures import gather_calls, image_failure

logger = logging.getLogger("moonserve.router")


class ImageFanIn:
    """The router's side of the image deployments: preprocess, then encode, all concurrently.

    `placeholder` is the token expanded to one per image token; `text` the prompt text of one
    image (default: the placeholder itself), which must hold the placeholder once. `engine_cache`
    (vision.handover encoder_cache): the LanguageModel gets the decoded images, and the encoder
    outputs only as references (`EncodingImages.engine_inputs`). `extra_tokens(width, height)`:
    the tokens the engine's processor adds to an image's pads (K3's sized wrapper; default none).
    """

    def __init__(self, placeholder: str, preprocessor, encoder, text: str | None = None,
                 engine_cache: bool = False, extra_tokens=None):
        self.placeholder = placeholder
        self.text = placeholder if text is None else text
        if self.text.count(placeholder) != 1:
            raise ValueError(f"vision.image_placeholder {placeholder!r} must occur once in the "
                             f"model's image prompt text {self.text!r}")
        self.preprocessor = preprocessor
        self.encoder = encoder
        self.engine_cache = engine_cache
        self.extra_tokens = extra_tokens

    def counts(self, infos: list[ImageInfo]) -> list[int]:
        """Each image's positions in the prompt, as the engine will have them."""
        if self.extra_tokens is None:
            return [info.num_image_tokens for info in infos]
        return [info.num_image_tokens + self.extra_tokens(*info.image_size) for info in infos]

    async def start(self, parts: list[tuple[int, int, str]]) -> EncodingImages:
        infos = await self.layout(parts)
        return EncodingImages(infos, [self.encoder.encode.remote(info) for info in infos])

    async def layout(self, parts: list[tuple[int, int, str]]) -> list[ImageInfo]:
        """Every image preprocessed (its token count known), none encoded."""
        return list(await gather_calls(*(self.preprocess(i, j, url) for i, j, url in parts)))

    async def preprocess(self, i: int, j: int, url: str) -> ImageInfo:
        try:
            return await self.preprocessor.preprocess.remote(url)
        except Exception as exc:
            raise image_failure(exc, f"messages[{i}].content[{j}]", "image preprocessor") from exc


@dataclass
class EncodingImages:
    """A request's images: their layout (known) and their encodings (in flight)."""

    infos: list[ImageInfo]
    responses: list  # DeploymentResponse per image, from the VisionEncoder

    @classmethod
    def none(cls) -> EncodingImages:
        return cls([], [])

    def release(self) -> None:
        """Cancel encodings still running (a refused or finished request) and drop the refs,
        so the object store can free pixels and embeddings while a long stream goes on."""
        for response in self.responses:
            response.cancel()
        self.infos, self.responses = [], []

    async def engine_inputs(self, engine_cache: bool) -> tuple[list, tuple]:
        """What the LanguageModel call carries, once every encoding exists: (its top-level
        arguments, `GenerateRequest.encoder_outputs`). Prompt embeddings: the outputs at the top
        level (Ray fetches them for the LM), none nested. `engine_cache`: the decoded images at
        the top level, and where each output is stored (`StoredEncoding`, no tensor), fetched
        from there only by a LanguageModel whose node store lacks it."""
        refs = await self.embeddings()
        if not engine_cache:
            return refs, ()
        stored = [await ref for ref in refs]
        for info, encoding in zip(self.infos, stored):
            warn_on_count_mismatch(info, encoding.num_image_tokens)
        return [info.image for info in self.infos], tuple(stored)

    async def embeddings(self) -> list:
        """ObjectRefs of the encoder outputs, once all exist (a failed encoding raises here)."""
        refs = []
        for k, response in enumerate(self.responses):
            try:
                ref = await response._to_object_ref()
                await ref  # raises if the encoding failed (numpy: a zero-copy read)
            except Exception as exc:
                raise image_failure(exc, f"image {k}", "vision encoder") from exc
            refs.append(ref)
        return refs


_count_mismatch_warned = False


def warn_on_count_mismatch(info: ImageInfo, engine_tokens: int) -> None:
    """Once per replica: the router's token count (context checks, lanes) differs from what
    vLLM's processor made of the image, so the preprocessor's layout fields do not match the
    checkpoint's `media_proc_cfg`."""
    global _count_mismatch_warned
    if info.num_image_tokens == engine_tokens or _count_mismatch_warned:
        return
    _count_mismatch_warned = True
    logger.warning("an image of %dx%d counts %d tokens here but %d in vLLM's processor: set "
                   "vision.preprocessor's layout fields to the checkpoint's media_proc_cfg",
                   *info.image_size, info.num_image_tokens, engine_tokens)
