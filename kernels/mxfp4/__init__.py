"""MXFP4 (OCP Microscaling v1.0): blocks of 32 E2M1 codes sharing one E8M0 scale.

`format` holds the storage rules in plain Python (shapes and dtype names), which the checkpoint
preflight uses without torch; so this package imports torch only when a torch name below is first
used. `naive` is the spec in plain torch. The Triton fast paths live in
`moonserve.kernels.mxfp4.triton`, imported explicitly, so that this package imports on machines
without triton. `linear` holds MXFP4Linear and the state-dict transforms that put MXFP4 weights,
as shipped, into a model.
"""

import importlib

from moonserve.kernels.mxfp4.format import BLOCK_SIZE

# Public name -> the submodule that defines it (torch-backed, imported on first use).
_LAZY = {"LoadSummary": "linear", "MXFP4Linear": "linear", "load_weights": "linear",
         "quantize_linear_weights": "linear", "dequantize": "naive", "matmul": "naive",
         "quantize": "naive"}

__all__ = ["BLOCK_SIZE", "LoadSummary", "MXFP4Linear", "dequantize", "load_weights", "matmul", "quantize",
           "quantize_linear_weights"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
