"""MXFP4 (OCP Microscaling v1.0): blocks of 32 E2M1 codes sharing one E8M0 scale.

`naive` is the spec in plain torch. The Triton fast paths live in `kernels.mxfp4.triton`, imported
explicitly, so that this package imports on machines without triton.
"""

from kernels.mxfp4.naive import BLOCK_SIZE, dequantize, matmul, quantize

__all__ = ["BLOCK_SIZE", "dequantize", "matmul", "quantize"]
