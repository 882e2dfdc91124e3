"""ImagePreprocessor throughput: our decode + preprocess against vLLM's own Kimi-K3 path.

vLLM's path, on the same bytes: `ImageMediaIO().load_bytes` (decode, EXIF, RGB) then
`KimiK25FusedVisionProcessor.preprocess` (the image processor vLLM's Kimi-K3 model uses: Pillow
BICUBIC resize, numba-fused pad/normalize/patchify). Both arms must give the same grid_thw for
every image (asserted) and their pixel_values are compared. Arms alternate round by round, so a
noisy machine slows both alike.

    >>> result = run(sample_images()[:1], rounds=1)  # doctest: +SKIP
    >>> result["end_to_end"]["speedup"]  # doctest: +SKIP
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image

from moonserve.pipeline.vision.preprocess import (
    DEFAULT_CONFIG,
    PreprocessConfig,
    decode_image,
    preprocess,
)

# (width, height, format) of the synthetic sample set: phone photo, HD frames, a tall screenshot,
# a small transparent icon, a tiny image.
SAMPLE_SPECS = [(4032, 3024, "JPEG"), (1920, 1080, "JPEG"), (1280, 720, "PNG"), (640, 480, "JPEG"),
                (800, 6000, "PNG"), (256, 256, "PNG"), (27, 29, "PNG")]


def vllm_media_proc_cfg(cfg: PreprocessConfig) -> dict:
    """The checkpoint `media_proc_cfg` vLLM's processor reads, built from our config."""
    return {"patch_size": cfg.patch_size, "merge_kernel_size": cfg.merge_size, "in_patch_limit": cfg.in_patch_limit,
            "patch_limit_on_one_side": cfg.patch_limit_on_one_side, "fixed_output_tokens": None,
            "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std),
            "temporal_merge_kernel_size": 4, "in_patch_limit_each_frame": None, "in_patch_limit_video": None}


class VllmKimiK3Preprocessor:
    """vLLM's Kimi-K3 image path (needs vllm and numba): bytes or RGB image -> (pixel_values, grid_thw)."""

    def __init__(self, cfg: PreprocessConfig = DEFAULT_CONFIG) -> None:
        from vllm.multimodal.media.image import ImageMediaIO
        from vllm.transformers_utils.processors.kimi_k25_vision_fused import (
            KimiK25FusedVisionProcessor,
        )

        self.media_io = ImageMediaIO(image_mode="RGB", rgba_background_color=cfg.background_rgb)
        self.processor = KimiK25FusedVisionProcessor(vllm_media_proc_cfg(cfg))

    def decode(self, data: bytes) -> Image.Image:
        return self.media_io.load_bytes(data).media

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.processor.preprocess([{"type": "image", "image": image}])
        return out["pixel_values"], tuple(out["grid_thws"][0].tolist())  # [N, 3, 14, 14], (t, h, w)

    def __call__(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        return self.preprocess(self.decode(data))


def sample_image(width: int, height: int, fmt: str, seed: int) -> bytes:
    """A photo-like image (smooth gradients plus noise) encoded in fmt; PNGs get an alpha channel."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200  # [H, W, 3]
    noise = rng.normal(0, 12, (height, width, 3)).astype(np.float32)
    pixels = np.clip(base + noise + 20, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if fmt == "PNG" and width * height <= 256 * 256:
        image.putalpha(Image.fromarray(((x + y) % 256).astype(np.uint8)))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def sample_images() -> list[bytes]:
    """The deterministic sample set (SAMPLE_SPECS), encoded."""
    return [sample_image(w, h, fmt, seed) for seed, (w, h, fmt) in enumerate(SAMPLE_SPECS)]


@dataclass
class Comparison:
    images: int
    rounds: int
    # From the median round: wall clock, and process CPU time (all threads), which a busy shared
    # machine disturbs less.
    ours_images_per_s: float
    vllm_images_per_s: float
    speedup: float  # ours / vLLM, wall clock
    ours_cpu_ms_per_image: float
    vllm_cpu_ms_per_image: float


@dataclass
class RoundTimes:
    wall_s: list[float]
    cpu_s: list[float]


def time_rounds(arms: dict[str, Callable[[], object]], rounds: int) -> dict[str, RoundTimes]:
    """Wall and CPU seconds of each round of each arm; arms alternate, after one warm-up run each."""
    times = {name: RoundTimes([], []) for name in arms}
    for fn in arms.values():
        fn()  # warm-up: numba compiles on first call
    for _ in range(rounds):
        for name, fn in arms.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].wall_s.append(time.perf_counter() - wall)
            times[name].cpu_s.append(time.process_time() - cpu)
    return times


def compare(ours: Callable[[], object], vllm: Callable[[], object], images: int, rounds: int) -> Comparison:
    times = time_rounds({"ours": ours, "vllm": vllm}, rounds)
    wall = {name: statistics.median(t.wall_s) for name, t in times.items()}
    cpu_ms = {name: statistics.median(t.cpu_s) * 1000 / images for name, t in times.items()}
    return Comparison(images, rounds, images / wall["ours"], images / wall["vllm"], wall["vllm"] / wall["ours"],
                      cpu_ms["ours"], cpu_ms["vllm"])


def check_outputs(images: list[bytes], cfg: PreprocessConfig, reference: VllmKimiK3Preprocessor) -> dict:
    """Assert equal grids image by image; the largest pixel_values difference and the patch count."""
    max_diff, patches = 0.0, 0
    for data in images:
        ours = preprocess(decode_image(data, cfg), cfg)
        pixel_values, grid_thw = reference(data)
        if ours.grid_thw != grid_thw:
            raise AssertionError(f"grid_thw differs: ours {ours.grid_thw}, vLLM {grid_thw}")
        max_diff = max(max_diff, (ours.pixel_values - pixel_values).abs().max().item())
        patches += pixel_values.shape[0]
    return {"pixel_values_max_abs_diff": max_diff, "total_patches": patches}


def run(images: list[bytes], rounds: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> dict:
    """Images/s of our preprocessing against vLLM's Kimi-K3 preprocessing on the same images.

    `end_to_end` times bytes -> pixel_values (decode included); `preprocess_only` times an RGB image
    -> pixel_values (resize, normalize, patchify). Returns a JSON-able dict.
    """
    reference = VllmKimiK3Preprocessor(cfg)
    checks = check_outputs(images, cfg, reference)
    decoded = [decode_image(data, cfg) for data in images]
    end_to_end = compare(lambda: [preprocess(decode_image(d, cfg), cfg) for d in images],
                         lambda: [reference(d) for d in images], len(images), rounds)
    preprocess_only = compare(lambda: [preprocess(image, cfg) for image in decoded],
                              lambda: [reference.preprocess(image) for image in decoded], len(images), rounds)
    return {"images": len(images), "rounds": rounds, "torch_threads": torch.get_num_threads(), **checks,
            "end_to_end": asdict(end_to_end), "preprocess_only": asdict(preprocess_only)}


if __name__ == "__main__":
    import json

    print(json.dumps(run(sample_images(), rounds=5), indent=2))
