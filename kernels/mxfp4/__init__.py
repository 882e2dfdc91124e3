"""MXFP4 (OCP Microscaling v1.0): blocks of 32 E2M1 codes sharing one E8M0 scale.

`naive` is the spec in plain torch. The Triton fast paths live in `moonserve.kernels.mxfp4.triton`, imported
explicitly, so that this package imports on machines without triton. `linear` holds MXFP4Linear
and the state-dict transforms that put MXFP4 weights, as shipped, into a model.
"""

from moonserve.kernels.mxfp4.linear import (
    LoadSummary,
    MXFP4Linear,
    load_weights,
    quantize_linear_weights,
)
from moonserve.kernels.mxfp4.naive import BLOCK_SIZE, dequantize, matmul, quantize

__all__ = ["BLOCK_SIZE", "LoadSummary", "MXFP4Linear", "dequantize", "load_weights", "matmul", "quantize",
           "quantize_linear_weights"]
