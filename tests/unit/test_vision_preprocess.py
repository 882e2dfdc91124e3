"""ImagePreprocessor building blocks on real Pillow-made files, checked against vLLM's Kimi-K3 path."""

from __future__ import annotations

import doctest
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, features

from moonserve.pipeline.bench.vision_preprocess import sample_image
from moonserve.pipeline.vision import errors
from moonserve.pipeline.vision import preprocess as preprocess_module
from moonserve.pipeline.vision.errors import ImageError
from moonserve.pipeline.vision.preprocess import (
    DEFAULT_CONFIG,
    PreprocessConfig,
    decode_image,
    navit_grid,
    navit_size,
    num_image_tokens,
    preprocess,
)

WHITE, RED, GREEN, BLUE = (255, 255, 255), (255, 0, 0), (0, 255, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)  # [H, W, 3] uint8


def png_chunk(tag: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))


def png_declaring(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose header declares width x height RGB; its pixel data is one byte."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\x00"))
            + png_chunk(b"IEND", b""))


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vllm_reference():
    """vLLM's own Kimi-K3 image path (ImageMediaIO + KimiK25FusedVisionProcessor)."""
    pytest.importorskip("vllm", reason="vllm is not installed; the comparison needs its Kimi-K3 processor")
    pytest.importorskip("numba", reason="vLLM's fused Kimi processor needs numba")
    from moonserve.pipeline.bench.vision_preprocess import VllmKimiK3Preprocessor

    return VllmKimiK3Preprocessor(DEFAULT_CONFIG)


@pytest.fixture(scope="module")
def vllm_navit():
    pytest.importorskip("vllm", reason="vllm is not installed; the size rules are compared with its own")
    from vllm.models.kimi_k3.common.mm_preprocess import navit_resize_image

    return navit_resize_image


def test_docstring_examples_run():
    assert doctest.testmod(preprocess_module).failed == 0


# Decoding: formats and modes.


@pytest.mark.parametrize("fmt, options", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("GIF", {})])
def test_lossless_formats_decode_to_the_same_pixels(fmt, options):
    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("this Pillow has no WebP support")
    source = noise(33, 17)
    if fmt == "GIF":  # GIF holds a palette: 8 colours survive exactly
        source = source.quantize(8).convert("RGB")
    image = decode_image(encode(source, fmt, **options))
    assert image.mode == "RGB" and image.size == (33, 17)
    assert np.array_equal(pixels(image), pixels(source))


def test_jpeg_decodes_to_its_size_in_rgb():
    image = decode_image(encode(noise(641, 479), "JPEG", quality=90))
    assert (image.mode, image.size) == ("RGB", (641, 479))


def test_rgba_is_composited_on_white():
    source = Image.new("RGBA", (4, 1))
    source.putdata([(255, 0, 0, 255), (255, 0, 0, 0), (0, 0, 0, 128), (0, 0, 255, 255)])
    row = pixels(decode_image(encode(source, "PNG")))[0]
    assert row[0].tolist() == list(RED) and row[1].tolist() == list(WHITE) and row[3].tolist() == list(BLUE)
    assert 126 <= row[2][0] <= 128  # half-transparent black over white


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_transparency_is_composited_on_white(fmt):
    source = Image.new("P", (4, 4), 0)
    source.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    source.paste(1, (0, 0, 2, 4))  # left half: palette index 1 (green); right half: transparent red
    image = decode_image(encode(source, fmt, transparency=0))
    assert pixels(image)[0].tolist() == [list(GREEN), list(GREEN), list(WHITE), list(WHITE)]


def test_grey_and_grey_alpha_become_rgb():
    grey = decode_image(encode(Image.new("L", (3, 2), 77), "PNG"))
    assert pixels(grey).tolist() == [[[77] * 3] * 3] * 2
    grey_alpha = Image.new("LA", (2, 1))
    grey_alpha.putdata([(77, 255), (77, 0)])
    assert pixels(decode_image(encode(grey_alpha, "PNG")))[0].tolist() == [[77] * 3, list(WHITE)]
    bilevel = decode_image(encode(Image.new("1", (2, 2), 1), "PNG"))
    assert pixels(bilevel).tolist() == [[list(WHITE)] * 2] * 2


def test_sixteen_bit_grey_png_keeps_its_top_byte():
    source = Image.fromarray(np.array([[0, 255, 256, 32768, 65535]], dtype=np.uint16))
    data = encode(source, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert pixels(decode_image(data))[0, :, 0].tolist() == [0, 0, 1, 128, 255]


def test_cmyk_jpeg_becomes_rgb(vllm_reference):
    data = encode(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95)  # red in CMYK
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    image = decode_image(data)
    assert image.mode == "RGB"
    assert np.abs(pixels(image)[16, 16].astype(int) - RED).max() <= 3
    assert np.array_equal(pixels(image), pixels(vllm_reference.decode(data)))


def exif_rotated_jpeg(orientation: int) -> bytes:
    """Stored 64x32 (WxH), blue with a red top-left 32x16 block, tagged with an EXIF orientation."""
    stored = Image.new("RGB", (64, 32), BLUE)
    stored.paste(RED, (0, 0, 32, 16))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(stored, "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_6_is_applied(vllm_reference):
    # Orientation 6: shown rotated 90 degrees clockwise, so the stored top-left block is displayed
    # at the top right of a 32x64 image.
    data = exif_rotated_jpeg(6)
    image = decode_image(data)
    assert image.size == (32, 64)
    shown = pixels(image).astype(int)
    assert np.abs(shown[8, 24] - RED).max() < 40  # top right: red
    assert np.abs(shown[8, 8] - BLUE).max() < 40 and np.abs(shown[48, 24] - BLUE).max() < 40
    assert np.array_equal(pixels(image), pixels(vllm_reference.decode(data)))
    assert preprocess(image).image_size == (32, 64)


def test_malformed_exif_leaves_the_image_usable():
    broken_exif = b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff\x01\x12"  # IFD cut short
    data = encode(Image.new("RGB", (16, 8), RED), "JPEG", quality=95, exif=broken_exif)
    with pytest.warns(UserWarning, match="Corrupt EXIF"):
        image = decode_image(data)
    assert image.size == (16, 8)


def test_animated_gif_uses_its_first_frame():
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), BLUE)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert pixels(decode_image(data)).reshape(-1, 3).tolist() == [list(RED)] * 64


@pytest.mark.parametrize(
    "make",
    [
        lambda: encode(Image.new("RGBA", (20, 9), (10, 20, 30, 100)), "PNG"),
        lambda: encode(Image.new("LA", (9, 20), (10, 100)), "PNG"),
        lambda: encode(noise(31, 30).convert("P"), "PNG", transparency=3),
        lambda: encode(noise(31, 30), "BMP"),
        lambda: encode(noise(31, 30), "WEBP", quality=80),
        lambda: exif_rotated_jpeg(3),
        lambda: exif_rotated_jpeg(8),
    ],
)
def test_decode_matches_vllm_image_media_io(vllm_reference, make):
    data = make()
    assert np.array_equal(pixels(decode_image(data)), pixels(vllm_reference.decode(data)))


# Decoding: rejections.


def reason_of(data: bytes, cfg: PreprocessConfig = DEFAULT_CONFIG) -> ImageError:
    with pytest.raises(ImageError) as caught:
        decode_image(data, cfg)
    return caught.value


SUPPORTED = "send PNG, JPEG, WebP, GIF, BMP"
GOOD_PNG = encode(noise(64, 64), "PNG")
GOOD_JPEG = encode(noise(64, 64), "JPEG")


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "image is empty (0 bytes)"),
        (GOOD_PNG[: len(GOOD_PNG) // 2], "truncated PNG file"),
        (GOOD_JPEG[: len(GOOD_JPEG) // 2], "truncated JPEG file"),
        (GOOD_PNG[:40], "corrupt PNG file (its header cannot be read)"),
        (b"this is plain text, saved as cat.png", f"not a supported image; {SUPPORTED}"),
        (b"\x89PNG\r\n\x1a\nhello, I am definitely a PNG", "corrupt PNG file (its header cannot be read)"),
        (b"GIF89a" + b"\xff" * 3, "corrupt GIF file (its header cannot be read)"),
        (b"BM" + b"\x00" * 60, "corrupt BMP file (its header cannot be read)"),
        (b"RIFF\x10\x00\x00\x00WEBPVP8 junk", "corrupt WEBP file (its header cannot be read)"),
        (GOOD_JPEG[:2] + GOOD_PNG[2:], f"not a supported image; {SUPPORTED}"),
        (b'<svg xmlns="http://www.w3.org/2000/svg"/>', f"SVG images are not supported; {SUPPORTED}"),
        (b'<?xml version="1.0"?><svg/>', f"SVG/XML images are not supported; {SUPPORTED}"),
        (encode(noise(8, 8), "TIFF"), f"TIFF images are not supported; {SUPPORTED}"),
        (encode(noise(16, 16), "ICO"), f"ICO images are not supported; {SUPPORTED}"),
        (png_declaring(0, 10), "corrupt PNG file (its header cannot be read)"),
    ],
    ids=["empty", "truncated-png", "truncated-jpeg", "png-cut-in-header", "text", "png-magic-then-text",
         "gif-magic-only", "bmp-zero-header", "webp-junk", "wrong-magic", "svg", "svg-xml", "tiff", "ico",
         "zero-width"],
)
def test_broken_files_are_rejected_with_a_reason(data, reason):
    error = reason_of(data)
    assert error.reason == reason
    assert error.code != errors.IMAGE_TOO_LARGE


def test_unsupported_formats_have_their_own_code():
    assert reason_of(encode(noise(8, 8), "TIFF")).code == errors.UNSUPPORTED_IMAGE


def test_corrupt_pixel_data_is_rejected():
    damaged = bytearray(GOOD_PNG)
    damaged[len(damaged) // 2: len(damaged) // 2 + 64] = b"\xff" * 64  # inside the IDAT stream
    assert reason_of(bytes(damaged)).reason in ("corrupt PNG file", "truncated PNG file")


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    """Fail the test if any image's pixels are decoded."""
    def refuse(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.mark.parametrize(
    "width, height, reason",
    [
        (9000, 9000, "image is 9000x9000 = 81,000,000 pixels, over the 16,000,000-pixel limit"),
        (20000, 20000, "image is 400,000,000 pixels, over the 16,000,000-pixel limit"),  # Pillow's own bomb error
        (4001, 4000, "image is 4001x4000 = 16,004,000 pixels, over the 16,000,000-pixel limit"),
    ],
)
def test_decompression_bombs_are_rejected_before_decoding(no_pixel_decoding, width, height, reason):
    data = png_declaring(width, height)
    assert len(data) < 100
    error = reason_of(data)
    assert error.reason == reason
    assert error.code == errors.IMAGE_TOO_LARGE


def test_size_between_pillows_limits_warns_and_is_rejected_by_ours(no_pixel_decoding):
    # 100 MP: over Pillow's 89 MP warning threshold, under its 179 MP error threshold.
    with pytest.warns(Image.DecompressionBombWarning):
        error = reason_of(png_declaring(10000, 10000))
    assert error.reason == "image is 10000x10000 = 100,000,000 pixels, over the 16,000,000-pixel limit"


def test_byte_limit_is_checked_first():
    error = reason_of(b"\x00" * 2001, PreprocessConfig(max_image_bytes=2000))
    assert error.reason == "image is 2,001 bytes, over the 2,000-byte limit"
    assert error.code == errors.IMAGE_TOO_LARGE


def test_pixel_limit_is_configurable():
    cfg = PreprocessConfig(max_image_pixels=64 * 64 - 1)
    assert reason_of(GOOD_PNG, cfg).reason == "image is 64x64 = 4,096 pixels, over the 4,095-pixel limit"
    assert decode_image(GOOD_PNG, PreprocessConfig(max_image_pixels=64 * 64)).size == (64, 64)


def test_one_by_100000_is_resized_not_rejected(vllm_reference):
    data = encode(noise(1, 100000), "PNG")
    out = preprocess(decode_image(data))
    assert (out.resized_size, out.grid_thw, out.num_image_tokens) == ((1, 7167), (1, 512, 2), 256)
    pixel_values, grid_thw = vllm_reference(data)
    assert grid_thw == out.grid_thw and torch.equal(out.pixel_values, pixel_values)


# Sizes: the NaViT rules against vLLM's navit_resize_image.

SIZES = [
    (1, 1), (2, 2), (3, 500), (500, 3), (13, 13), (14, 14), (15, 15), (27, 29), (28, 28), (29, 27), (56, 56),
    (224, 224), (225, 223), (640, 480), (1024, 768), (1280, 720), (1920, 1080), (1080, 1920), (3840, 2160),
    (4000, 30), (30, 4000), (4000, 3000), (4032, 3024), (8000, 6000), (1792, 1792), (1793, 1791), (3585, 3585),
    (7168, 7168), (7169, 7169), (7200, 300), (300, 7200), (1, 100000), (100000, 1), (100000, 100),
    (2, 70000), (16384, 1), (56, 16384), (12345, 678), (999, 1001), (5000, 5000),
]


def vllm_expected(vllm_navit, width: int, height: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> dict:
    """vLLM's resize config turned into our terms: resized size, grid_thw, token count."""
    r = vllm_navit(width, height, cfg.patch_size, cfg.merge_size, cfg.in_patch_limit, cfg.patch_limit_on_one_side,
                   None)
    padded_w, padded_h = r["new_width"] + r["pad_width"], r["new_height"] + r["pad_height"]
    grid = (1, padded_h // cfg.patch_size, padded_w // cfg.patch_size)
    return {"size": (r["new_width"], r["new_height"]), "grid_thw": grid, "num_tokens": r["num_tokens"]}


def ours(width: int, height: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> dict:
    grid = navit_grid(width, height, cfg)
    return {"size": navit_size(width, height, cfg), "grid_thw": grid, "num_tokens": num_image_tokens(grid, cfg)}


@pytest.mark.parametrize("width, height", SIZES)
def test_navit_sizes_match_vllm(vllm_navit, width, height):
    assert ours(width, height) == vllm_expected(vllm_navit, width, height)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(width=st.integers(1, 30000), height=st.integers(1, 30000))
def test_navit_sizes_match_vllm_everywhere(vllm_navit, width, height):
    assert ours(width, height) == vllm_expected(vllm_navit, width, height)


@pytest.mark.parametrize("cfg", [PreprocessConfig(in_patch_limit=4096, patch_limit_on_one_side=64),
                                 PreprocessConfig(in_patch_limit=65536), PreprocessConfig(patch_size=16)])
@pytest.mark.parametrize("width, height", [(4032, 3024), (100000, 100), (27, 29), (3585, 3585)])
def test_navit_sizes_match_vllm_under_other_limits(vllm_navit, cfg, width, height):
    assert ours(width, height, cfg) == vllm_expected(vllm_navit, width, height, cfg)


def test_grid_sides_are_multiples_of_the_merge_kernel():
    for width, height in SIZES:
        _, grid_h, grid_w = navit_grid(width, height)
        assert grid_h % 2 == 0 and grid_w % 2 == 0 and grid_h <= 512 and grid_w <= 512


# preprocess: the whole pipeline against vLLM's.


@pytest.mark.parametrize(
    "make",
    [
        lambda: sample_image(1920, 1080, "JPEG", seed=1),
        lambda: sample_image(640, 480, "JPEG", seed=2),
        lambda: sample_image(256, 256, "PNG", seed=3),  # RGBA
        lambda: sample_image(27, 29, "PNG", seed=4),
        lambda: encode(noise(14, 14), "BMP"),
        lambda: exif_rotated_jpeg(6),
    ],
    ids=["jpeg-1920x1080", "jpeg-640x480", "rgba-png-256", "png-27x29", "bmp-14x14", "exif-6"],
)
def test_pixel_values_equal_vllm_kimi_k3_preprocessing(vllm_reference, make):
    data = make()
    out = preprocess(decode_image(data))
    pixel_values, grid_thw = vllm_reference(data)
    assert out.grid_thw == grid_thw
    assert out.pixel_values.dtype == torch.float32
    assert out.pixel_values.shape == (grid_thw[1] * grid_thw[2], 3, 14, 14) == pixel_values.shape
    assert torch.equal(out.pixel_values, pixel_values)  # bit-exact, well inside any fp32 tolerance
    assert out.num_image_tokens == grid_thw[1] * grid_thw[2] // 4


def test_a_transparent_png_reaches_k3s_tower_as_vllm_makes_it(vllm_reference):
    """`vision.handover: encoder_cache` hands vLLM the ImagePreprocessor's decoded image. A
    transparent PNG (colours under alpha 0, partial alpha) must give the K3 processor the
    pixel_values vLLM makes of the same file on its own, in both its paths: the chat server's
    `ImageMediaIO(image_mode="RGB")` and an RGBA PIL image in a prompt (`MultiModalDataParser`).
    Both composite on white (vllm/multimodal/image.py `rgba_to_rgb`); keeping the colours under
    the alpha (`convert("RGB")`) would differ, and the test checks that it does."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    from moonserve.deployments.preprocess import decode_and_count

    rgba = np.random.default_rng(7).integers(0, 256, (37, 53, 4), dtype=np.uint8)
    rgba[:, :20, 3] = 0  # fully transparent, colours hidden under it
    data = encode(Image.fromarray(rgba, "RGBA"), "PNG")

    def parsed(image):  # what vLLM's engine does with an image a prompt carries
        return MultiModalDataParser().parse_mm_data({"image": [image]})["image"].get(0)

    ours = vllm_reference.preprocess(parsed(decode_and_count(data, DEFAULT_CONFIG)[0]))[0]
    served = vllm_reference.preprocess(ImageMediaIO(image_mode="RGB").load_bytes(data).media)[0]
    prompted = vllm_reference.preprocess(parsed(Image.open(io.BytesIO(data))))[0]
    assert torch.equal(ours, served) and torch.equal(ours, prompted)
    kept = vllm_reference.preprocess(Image.open(io.BytesIO(data)).convert("RGB"))[0]
    assert not torch.equal(ours, kept)


def test_preprocess_layout_on_a_known_image():
    image = Image.new("RGB", (30, 20), RED)  # resized as is; grid 2x4 patches, padded bottom and right
    out = preprocess(image)
    assert (out.grid_thw, out.num_image_tokens, out.resized_size) == ((1, 2, 4), 2, (30, 20))
    assert out.pixel_values[0, :, 0, 0].tolist() == [1.0, -1.0, -1.0]  # red, normalized with 0.5/0.5
    assert out.pixel_values[7, :, 13, 13].tolist() == [-1.0, -1.0, -1.0]  # padding: pixel 0 normalized


def test_preprocess_needs_rgb():
    with pytest.raises(ValueError, match="needs an RGB image"):
        preprocess(Image.new("L", (4, 4)))


def test_phone_photo_is_scaled_down_to_the_patch_limit():
    out = preprocess(Image.new("RGB", (4032, 3024), GREEN))
    assert (out.image_size, out.resized_size, out.grid_thw) == ((4032, 3024), (2069, 1551), (1, 112, 148))
    assert out.num_image_tokens == 56 * 74


@pytest.mark.parametrize(
    "options, match",
    [
        ({"merge_kernel": (2, 3)}, "merge_kernel must be square"),
        ({"patch_limit_on_one_side": 511}, "patch_limit_on_one_side \\(511\\) must be a multiple"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_mean/image_std"),
        ({"max_image_pixels": 0}, "max_image_pixels must be positive"),
    ],
)
def test_bad_config_names_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        PreprocessConfig(**options)
