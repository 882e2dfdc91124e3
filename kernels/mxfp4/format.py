"""The MXFP4 storage format's rules in plain Python: which tensors make one packed weight, and its shape.

One rule for every reader: ``moonserve.kernels.mxfp4.linear`` applies it to tensors, the checkpoint
preflight (``moonserve check-checkpoint``) to safetensors headers, which it reads without torch. So it
takes shapes and safetensors dtype names (``"U8"``, ``"F8_E8M0"``), never tensors.

A packed weight ``X`` of logical shape ``[..., K]`` (``K = G * 32``) is two tensors:

* values: ``G`` blocks of 32 E2M1 codes, two per byte, stored ``U8``, either gpt-oss's block view
  ``X_blocks [..., G, 16]`` or compressed-tensors' flat view ``X.weight_packed [..., G * 16]``;
* scales: one E8M0 exponent per block, ``[..., G]``, stored ``U8`` or ``F8_E8M0``.

Example:
    >>> packed_layout((896, 4096, 224, 16), (896, 4096, 224))
    ('mxfp4-blocks', (896, 4096, 7168))
    >>> packed_layout((4096, 3584), (4096, 224), allow_flat=True)
    ('mxfp4-flat', (4096, 7168))
    >>> packed_layout((4096, 3584), (4096, 224)) is None  # the flat view only where it is allowed
    True
    >>> dtypes_fit("U8", "F8_E8M0"), dtypes_fit("U8", "F32")
    (True, False)
"""

from __future__ import annotations

BLOCK_SIZE = 32  # values per block, sharing one scale
BLOCK_BYTES = BLOCK_SIZE // 2  # two 4-bit codes per byte
# gpt-oss names: X_blocks + X_scales, beside the checkpoint's float tensors.
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCKS_DTYPE = "U8"
SCALES_DTYPES = ("U8", "F8_E8M0")  # both hold the biased exponent

Shape = tuple[int, ...]


def is_packed_part(name: str) -> bool:
    """True for a gpt-oss MXFP4 half, ``X_blocks`` or ``X_scales``."""
    return name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))


def dtypes_fit(blocks_dtype: str, scales_dtype: str) -> bool:
    """Whether values and scales have MXFP4's dtypes (safetensors names): U8, and U8 or F8_E8M0."""
    return blocks_dtype == BLOCKS_DTYPE and scales_dtype in SCALES_DTYPES


def packed_layout(blocks: Shape, scales: Shape, *, allow_flat: bool = False) -> tuple[str, Shape] | None:
    """``("mxfp4-blocks" | "mxfp4-flat", logical shape [..., G * 32])`` when the values' and the
    scales' shapes fit together, else None. ``allow_flat``: also accept values ``[..., G * 16]``."""
    blocks, scales = tuple(blocks), tuple(scales)
    if len(blocks) >= 2 and blocks[-1] == BLOCK_BYTES and scales == blocks[:-1]:
        return "mxfp4-blocks", blocks[:-2] + (blocks[-2] * BLOCK_SIZE,)
    flat = (allow_flat and len(blocks) == len(scales) >= 1 and scales[:-1] == blocks[:-1]
            and blocks[-1] == scales[-1] * BLOCK_BYTES)
    return ("mxfp4-flat", blocks[:-1] + (blocks[-1] * 2,)) if flat else None


def logical_shape(blocks: Shape, scales: Shape) -> Shape | None:
    """The logical shape ``[..., G * 32]`` of blocks ``[..., G, 16]`` with scales ``[..., G]``, else None."""
    layout = packed_layout(blocks, scales)
    return None if layout is None else layout[1]
