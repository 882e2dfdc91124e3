"""MXFP4 linear layers: weights kept as shipped (packed E2M1 blocks + E8M0 scales), decoded per matmul.

A checkpoint stores the MXFP4 weight of a linear ``X`` the gpt-oss way, as two tensors beside its
float ones: ``X.weight_blocks`` uint8 ``[out, in // 32, 16]`` and ``X.weight_scales`` uint8
``[out, in // 32]`` (logical weight ``X.weight`` ``[out, in]``; see moonserve.kernels.mxfp4.naive for the
bit layout). ``MXFP4Linear`` holds exactly those two buffers, under those names, plus an optional
float bias, and computes ``x @ dequantize(W).T + bias``: with ``moonserve.kernels.mxfp4.triton.matmul`` on
GPU tensors (weights decoded in registers, never written out) when triton is installed, with
``moonserve.kernels.mxfp4.naive.matmul`` otherwise.

``quantize_linear_weights`` turns a float state dict into that form; ``load_weights`` loads such
a state dict into a model built with ``nn.Linear``s, swapping in an ``MXFP4Linear`` for each
linear whose weight comes packed (a transform applied to a built model, not a flag in its code).

Example:

    >>> import torch
    >>> from torch import nn
    >>> from moonserve.kernels.mxfp4.linear import MXFP4Linear, load_weights, quantize_linear_weights
    >>> model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 10))
    >>> packed = quantize_linear_weights(model.state_dict())  # 10 x 96 too: 96 = 3 blocks
    >>> sorted(packed)[:3], packed["0.weight_blocks"].shape, packed["0.weight_scales"].shape
    (['0.bias', '0.weight_blocks', '0.weight_scales'], torch.Size([96, 2, 16]), torch.Size([96, 2]))
    >>> fresh = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 10))
    >>> summary = load_weights(fresh, packed)
    >>> summary.mxfp4_linears, summary.packed_bytes, summary.float_bytes
    (('0', '2'), 3774, 28416)
    >>> fresh[0]
    MXFP4Linear(in_features=64, out_features=96, bias=True)
    >>> fresh(torch.randn(7, 3, 64)).shape  # leading dims are kept
    torch.Size([7, 3, 10])
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from moonserve.kernels.mxfp4 import naive
from moonserve.kernels.mxfp4.format import (
    BLOCK_SIZE,
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    dtypes_fit,
    is_packed_part,
    logical_shape,
)

# The safetensors names of the torch dtypes MXFP4 halves ship in (the format's rule speaks those):
# E8M0 scales come as uint8 (gpt-oss) or float8_e8m0fnu; both hold the biased exponent.
SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.float8_e8m0fnu: "F8_E8M0"}


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class MXFP4Linear(nn.Module):
    """``y = x @ W.T + b`` with W [out_features, in_features] stored as MXFP4.

    Buffers ``weight_blocks`` uint8 [out, in // 32, 16] and ``weight_scales`` uint8 [out, in // 32]
    (zeros until loaded); ``bias`` [out] a float parameter (dtype ``dtype``) or None. forward takes
    x [..., in_features] (float32 or bfloat16) and returns [..., out_features] in x.dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if in_features <= 0 or in_features % BLOCK_SIZE:
            raise ValueError(f"MXFP4Linear needs in_features to be a positive multiple of {BLOCK_SIZE} "
                             f"(one E8M0 scale per {BLOCK_SIZE} inputs), got in_features={in_features}")
        self.in_features, self.out_features = in_features, out_features
        num_blocks = in_features // BLOCK_SIZE
        self.register_buffer("weight_blocks", torch.zeros(out_features, num_blocks, BLOCK_SIZE // 2,
                                                          dtype=torch.uint8, device=device))
        self.register_buffer("weight_scales", torch.zeros(out_features, num_blocks, dtype=torch.uint8,
                                                          device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXFP4Linear:
        """linear's weight quantized with moonserve.kernels.mxfp4.naive.quantize, its bias kept as it is."""
        weight = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     device=weight.device, dtype=weight.dtype)
        module.weight_blocks, module.weight_scales = naive.quantize(weight)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [M, in_features]
        if x.is_cuda and triton_available():
            from moonserve.kernels.mxfp4 import triton as mxfp4_triton

            y = mxfp4_triton.matmul(x2d, self.weight_blocks, self.weight_scales)  # [M, out_features]
        else:
            y = naive.matmul(x2d, self.weight_blocks, self.weight_scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def is_quantizable_weight(name: str, tensor: torch.Tensor) -> bool:
    """The default selection: a 2-D float ``*.weight`` whose in-dim (last) is a multiple of 32.

    Linear weights pass; norms (1-D) and convolutions (4-D) do not. An embedding table is 2-D
    too, and nothing in a state dict tells it from a linear: exclude it with your own ``select``.
    """
    return (name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()
            and tensor.shape[1] % BLOCK_SIZE == 0)


def quantize_linear_weights(
    state_dict: Mapping[str, torch.Tensor],
    select: Callable[[str, torch.Tensor], bool] = is_quantizable_weight,
) -> dict[str, torch.Tensor]:
    """A new state dict in which each selected ``X.weight`` [out, in] becomes ``X.weight_blocks``
    uint8 [out, in // 32, 16] + ``X.weight_scales`` uint8 [out, in // 32]; other tensors are kept.

    >>> packed = quantize_linear_weights({"fc.weight": torch.randn(8, 64), "norm.weight": torch.ones(64)},
    ...                                  select=lambda name, t: name.startswith("fc."))
    >>> {name: list(t.shape) for name, t in packed.items()}
    {'fc.weight_blocks': [8, 2, 16], 'fc.weight_scales': [8, 2], 'norm.weight': [64]}
    """
    out = {}
    for name, tensor in state_dict.items():
        if not select(name, tensor):
            out[name] = tensor
            continue
        if tensor.dim() != 2 or not tensor.is_floating_point() or tensor.shape[1] % BLOCK_SIZE:
            raise ValueError(f"cannot quantize {name} ({tensor.dtype} {list(tensor.shape)}) to MXFP4: need a "
                             f"2-D float weight whose in-dim is a multiple of {BLOCK_SIZE}")
        out[name + BLOCKS_SUFFIX], out[name + SCALES_SUFFIX] = naive.quantize(tensor.detach())
    return out


def packed_weight_shape(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, ...] | None:
    """The logical shape [..., G * 32] of blocks [..., G, 16] with scales [..., G], or None if they
    do not fit together (dtypes are not looked at: pair_dtypes_fit does)."""
    return logical_shape(tuple(blocks.shape), tuple(scales.shape))


def pair_dtypes_fit(blocks: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether blocks are uint8 and scales uint8 or float8_e8m0fnu (the format's dtype rule)."""
    return dtypes_fit(*(SAFETENSORS_DTYPES.get(t.dtype, str(t.dtype)) for t in (blocks, scales)))


def packed_weight_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Logical names ``X`` of every ``X_blocks`` / ``X_scales`` tensor, in order of first appearance."""
    names = (name.removesuffix(BLOCKS_SUFFIX).removesuffix(SCALES_SUFFIX) for name in tensors
             if is_packed_part(name))
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class LoadSummary:
    """What load_weights did: which linears are now MXFP4, and what their weights take."""

    mxfp4_linears: tuple[str, ...]  # module names, now MXFP4Linear, in module order
    packed_bytes: int  # their blocks + scales
    float_bytes: int  # the same weights in the dtype of the nn.Linear each one replaced (of the
    # bias, or the default dtype, where an MXFP4Linear was already in place)

    @property
    def num_mxfp4_linears(self) -> int:
        return len(self.mxfp4_linears)


def load_weights(module: nn.Module, tensors: Mapping[str, torch.Tensor], strict: bool = True, *,
                 assign: bool = False) -> LoadSummary:
    """Load a state dict in which some linear weights come as ``X.weight_blocks`` + ``X.weight_scales``.

    Each such pair turns the ``nn.Linear`` ``X`` of module into an MXFP4Linear (same device, bias
    kept); then every tensor is loaded with ``module.load_state_dict(..., strict, assign)``
    (``assign=True`` for a module built on the meta device). Everything below is checked before
    module is touched, and raises a ValueError naming the tensor: a blocks tensor without its
    scales or the reverse, a dtype other than uint8 (scales: or float8_e8m0fnu), a pair that does
    not fit its linear (both shapes given), and, when strict, every missing and every unexpected
    tensor. A pair whose ``X`` is no linear of module counts as unexpected.
    """
    tensors = dict(tensors)
    targets = {}  # module name -> the linear its pair replaces
    for weight_name in packed_weight_names(tensors):
        blocks, scales = check_pair(weight_name, tensors)
        tensors[weight_name + SCALES_SUFFIX] = scales  # float8_e8m0fnu scales as their uint8 codes
        name = weight_name.removesuffix(".weight")
        linear = find_linear(module, name) if weight_name.endswith(".weight") else None
        if linear is not None:
            check_pair_fits(weight_name, blocks, scales, linear)
            targets[name] = linear
    if strict:
        check_names(type(module).__name__, expected_names(module, targets), tensors)
    float_dtypes = {name: swap_in_mxfp4(module, name, linear) for name, linear in targets.items()}
    module.load_state_dict(tensors, strict=strict, assign=assign)
    return summarize(module, float_dtypes)


def check_pair(weight_name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales as uint8) of weight_name, after checking both are there with MXFP4 dtypes."""
    blocks_name, scales_name = weight_name + BLOCKS_SUFFIX, weight_name + SCALES_SUFFIX
    blocks, scales = tensors.get(blocks_name), tensors.get(scales_name)
    if blocks is None or scales is None:
        present, absent = (blocks_name, scales_name) if scales is None else (scales_name, blocks_name)
        raise ValueError(f"{present} {list(tensors[present].shape)} comes without {absent}: MXFP4 weights "
                         f"load as {BLOCKS_SUFFIX} + {SCALES_SUFFIX} pairs")
    if not pair_dtypes_fit(blocks, scales):
        raise ValueError(f"{blocks_name} / {scales_name} have dtypes {blocks.dtype} / {scales.dtype}; MXFP4 "
                         f"needs uint8 blocks and uint8 (or float8_e8m0fnu) scales")
    return blocks, scales.view(torch.uint8)


def find_linear(module: nn.Module, name: str) -> nn.Linear | MXFP4Linear | None:
    """The submodule called name if it is a linear (plain or already MXFP4), else None."""
    try:
        target = module.get_submodule(name) if name else None
    except AttributeError:
        return None
    return target if isinstance(target, nn.Linear | MXFP4Linear) else None


def check_pair_fits(weight_name: str, blocks: torch.Tensor, scales: torch.Tensor,
                    linear: nn.Linear | MXFP4Linear) -> None:
    wanted = (linear.out_features, linear.in_features)
    if packed_weight_shape(blocks, scales) != wanted:
        raise ValueError(
            f"{weight_name}{BLOCKS_SUFFIX} {list(blocks.shape)} + {weight_name}{SCALES_SUFFIX} "
            f"{list(scales.shape)} do not fit {type(linear).__name__} {weight_name.removesuffix('.weight')} "
            f"with weight {list(wanted)}: it needs blocks {[wanted[0], wanted[1] // BLOCK_SIZE, BLOCK_SIZE // 2]} "
            f"and scales {[wanted[0], wanted[1] // BLOCK_SIZE]}"
        )


def swap_in_mxfp4(module: nn.Module, name: str, linear: nn.Linear | MXFP4Linear) -> torch.dtype:
    """Put an (unloaded) MXFP4Linear where linear is; returns the replaced weight's dtype."""
    if isinstance(linear, MXFP4Linear):
        return linear.bias.dtype if linear.bias is not None else torch.get_default_dtype()
    weight = linear.weight
    replacement = MXFP4Linear(linear.in_features, linear.out_features, linear.bias is not None,
                              device=weight.device, dtype=weight.dtype)
    parent_name, _, child_name = name.rpartition(".")
    setattr(module.get_submodule(parent_name), child_name, replacement)
    return weight.dtype


def expected_names(module: nn.Module, targets: Mapping[str, nn.Module]) -> list[str]:
    """module's state dict names once each target holds an MXFP4 weight."""
    packed = {f"{name}.weight" for name in targets}  # an MXFP4Linear target has no .weight: kept
    names = []
    for name in module.state_dict():
        names += [name + BLOCKS_SUFFIX, name + SCALES_SUFFIX] if name in packed else [name]
    return names


def check_names(module_type: str, expected: list[str], tensors: Mapping[str, torch.Tensor]) -> None:
    expected_set = set(expected)
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected_set]
    if missing or unexpected:
        parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
            [f"unexpected tensors: {', '.join(unexpected)}"] if unexpected else [])
        raise ValueError(f"state dict does not fit {module_type}: " + "; ".join(parts))


def summarize(module: nn.Module, float_dtypes: Mapping[str, torch.dtype]) -> LoadSummary:
    linears = {name: m for name, m in module.named_modules() if name in float_dtypes}  # in module order
    packed = sum(m.weight_blocks.nbytes + m.weight_scales.nbytes for m in linears.values())
    float_bytes = sum(m.in_features * m.out_features * float_dtypes[name].itemsize for name, m in linears.items())
    return LoadSummary(tuple(linears), packed, float_bytes)
