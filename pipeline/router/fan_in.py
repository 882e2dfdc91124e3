"""The Router's side of the image deployments: every image part preprocessed, then encoded, all
concurrently, while the prompt is tokenized and the request waits for its lane.

Example (`preprocessor` and `encoder` are the ImagePreprocessor and VisionEncoder handles):
    >>> fan_in = ImageFanIn("<empty_output>", preprocessor, encoder)
    >>> images = await fan_in.start([(0, 1, "data:image/png;base64,...")])  # (message, part, url)
    >>> try: refs = await images.embeddings()     # ObjectRefs of [num_image_tokens, hidden]
    ... finally: images.release()
"""

from __future__ import annotations

from dataclasses import dataclass

from moonserve.pipeline.api.protocol import ImageInfo
from moonserve.pipeline.router.failures import gather_calls, image_failure


class ImageFanIn:
    """The router's side of the image deployments: preprocess, then encode, all concurrently."""

    def __init__(self, placeholder: str, preprocessor, encoder):
        self.placeholder = placeholder
        self.preprocessor = preprocessor
        self.encoder = encoder

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

    def num_tokens(self) -> list[int]:
        return [info.num_image_tokens for info in self.infos]

    def release(self) -> None:
        """Cancel encodings still running (a refused or finished request) and drop the refs,
        so the object store can free pixels and embeddings while a long stream goes on."""
        for response in self.responses:
            response.cancel()
        self.infos, self.responses = [], []

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
