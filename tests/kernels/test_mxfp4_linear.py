"""MXFP4Linear and its state-dict transforms: forward = x @ dequantize(W).T + b, exact against
nn.Linear on representable weights, a safetensors round trip, and errors that name the tensor."""

from __future__ import annotations

import doctest
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moonserve.kernels.checks import relative_rms
from moonserve.kernels.mxfp4 import linear as mxfp4_linear
from moonserve.kernels.mxfp4.linear import (
    MXFP4Linear,
    is_quantizable_weight,
    load_weights,
    quantize_linear_weights,
)
from moonserve.kernels.mxfp4.naive import dequantize, quantize

# Magnitudes of E2M1 codes 0..7, written out here rather than taken from naive.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_SIGNED = torch.cat([E2M1, -E2M1])  # [16], indexed by code


def representable_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """[out, in] float32 whose every block of 32 is E2M1 values times one power of two (2**-9..2**-3),
    with a +-6 in each block so that the shared exponent is that power: MXFP4 holds it exactly."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator)
    codes[..., 0] = 7 + 8 * torch.randint(0, 2, codes.shape[:-1], generator=generator)  # +-6
    exponents = torch.randint(-9, -2, (out_features, in_features // 32, 1), generator=generator)
    return torch.ldexp(E2M1_SIGNED[codes], exponents.float()).flatten(1)


def packed_layer(out_features: int, in_features: int, bias: bool, seed: int = 0) -> MXFP4Linear:
    """An MXFP4Linear holding quantize(randn) weights and, if asked, a randn bias."""
    generator = torch.Generator().manual_seed(seed)
    layer = MXFP4Linear(in_features, out_features, bias)
    blocks, scales = quantize(torch.randn(out_features, in_features, generator=generator) / in_features**0.5)
    layer.weight_blocks.copy_(blocks)
    layer.weight_scales.copy_(scales)
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=generator))
    return layer


class Tiny(nn.Module):
    """Embedding, two linears (one with a bias), a norm, and a linear whose in-dim (48) MXFP4 cannot take."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.proj = nn.Linear(64, 96)
        self.norm = nn.LayerNorm(96)
        self.head = nn.Linear(96, 33, bias=False)
        self.side = nn.Linear(48, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(ids))))


def not_embedding(name: str, tensor: torch.Tensor) -> bool:
    return is_quantizable_weight(name, tensor) and not name.startswith("embed.")


def tiny_packed(seed: int = 0) -> tuple[Tiny, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = Tiny().eval()
    return model, quantize_linear_weights(model.state_dict(), select=not_embedding)


def test_docstring_examples_run():
    assert doctest.testmod(mxfp4_linear).failed == 0


@pytest.mark.parametrize("leading", [(63,), (2, 3, 5), (), (4, 0), (1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_x_times_dequantized_transpose(leading, bias):
    layer = packed_layer(47, 160, bias)  # 5 blocks; 47 outputs
    x = torch.randn(*leading, 160, generator=torch.Generator().manual_seed(1))
    weight = dequantize(layer.weight_blocks, layer.weight_scales)  # [47, 160]
    expected = x @ weight.T + (layer.bias if bias else 0)
    with torch.inference_mode():
        actual = layer(x)
    assert actual.shape == (*leading, 47) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_input_gives_bfloat16_output():
    layer = packed_layer(47, 160, bias=True)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        y16, y32 = layer(x.bfloat16()), layer(x.bfloat16().float())
    assert y16.dtype == torch.bfloat16
    assert relative_rms(y16, y32) < 2.0**-8  # one bf16 rounding of each output (bias added in bf16)


@pytest.mark.parametrize("bias", [True, False])
def test_equals_float_linear_on_representable_weights(bias):
    torch.manual_seed(3)
    float_layer = nn.Linear(96, 781, bias=bias)
    float_layer.weight.data = representable_weight(781, 96, seed=4)
    layer = MXFP4Linear.from_linear(float_layer)
    assert torch.equal(dequantize(layer.weight_blocks, layer.weight_scales), float_layer.weight)
    x = torch.randn(3, 21, 96)
    with torch.inference_mode():
        actual, expected = layer(x), float_layer(x)
    if bias:  # nn.Linear adds the bias inside addmm: one rounding apart
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("in_features", [48, 31, 0])
def test_in_features_not_a_multiple_of_32_is_named(in_features):
    with pytest.raises(ValueError, match=f"multiple of 32 .* got in_features={in_features}"):
        MXFP4Linear(in_features, 8)


def test_quantize_linear_weights_selects_2d_float_weights_with_block_in_dims():
    model, packed = tiny_packed()
    state = model.state_dict()
    assert set(packed) == {"embed.weight", "proj.weight_blocks", "proj.weight_scales", "proj.bias", "norm.weight",
                           "norm.bias", "head.weight_blocks", "head.weight_scales", "side.weight", "side.bias"}
    assert packed["head.weight_blocks"].shape == (33, 3, 16) and packed["head.weight_scales"].shape == (33, 3)
    assert packed["proj.weight_blocks"].dtype == packed["proj.weight_scales"].dtype == torch.uint8
    assert all(torch.equal(packed[name], state[name]) for name in ("embed.weight", "norm.weight", "side.weight", "proj.bias"))
    default = quantize_linear_weights(state)  # the default cannot tell an embedding from a linear
    assert "embed.weight_blocks" in default and "side.weight" in default  # 48 inputs: not 32-divisible
    with pytest.raises(ValueError, match=re.escape("cannot quantize side.weight (torch.float32 [8, 48])")):
        quantize_linear_weights(state, select=lambda name, t: name == "side.weight")


def test_round_trip_through_safetensors(tmp_path):
    model, packed = tiny_packed()
    save_file({name: t.contiguous() for name, t in packed.items()}, str(tmp_path / "model.safetensors"))
    fresh = Tiny().eval()
    summary = load_weights(fresh, load_file(tmp_path / "model.safetensors"))
    assert summary.mxfp4_linears == ("proj", "head") and summary.num_mxfp4_linears == 2
    assert summary.packed_bytes == (96 * 2 + 33 * 3) * 17  # 16 bytes of codes + 1 scale per block
    assert summary.float_bytes == (96 * 64 + 33 * 96) * 4
    assert isinstance(fresh.proj, MXFP4Linear) and isinstance(fresh.head, MXFP4Linear)
    assert type(fresh.side) is nn.Linear and type(fresh.embed) is nn.Embedding
    assert fresh.state_dict().keys() == packed.keys()
    assert all(torch.equal(t, packed[name]) for name, t in fresh.state_dict().items())
    # The float model with the dequantized weights is what the MXFP4 model computes.
    for name in ("proj", "head"):
        getattr(model, name).weight.data = dequantize(packed[f"{name}.weight_blocks"], packed[f"{name}.weight_scales"])
    ids = torch.randint(0, 50, (4, 7))
    with torch.inference_mode():
        torch.testing.assert_close(fresh(ids), model(ids), rtol=1e-6, atol=1e-6)


def test_loading_again_into_mxfp4_linears_and_e8m0_scales(tmp_path):
    _, packed = tiny_packed()
    fresh = Tiny()
    load_weights(fresh, packed)
    as_e8m0 = {name: t.view(torch.float8_e8m0fnu) if name.endswith("_scales") else t for name, t in packed.items()}
    save_file(as_e8m0, str(tmp_path / "e8m0.safetensors"))  # safetensors' F8_E8M0
    summary = load_weights(fresh, load_file(tmp_path / "e8m0.safetensors"))  # already MXFP4Linear: loads in place
    assert summary.num_mxfp4_linears == 2
    assert fresh.head.weight_scales.dtype == torch.uint8
    assert torch.equal(fresh.head.weight_scales, packed["head.weight_scales"])


def test_meta_module_loads_with_assign():
    _, packed = tiny_packed()
    with torch.device("meta"):
        fresh = Tiny()
    load_weights(fresh, packed, assign=True)
    assert fresh.proj.weight_blocks.device.type == "cpu" and fresh.proj.bias.device.type == "cpu"
    assert torch.equal(fresh.proj.weight_blocks, packed["proj.weight_blocks"])


def broken(edit) -> dict[str, torch.Tensor]:
    _, packed = tiny_packed()
    edit(packed)
    return packed


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("proj.weight_scales"),
     "proj.weight_blocks [96, 2, 16] comes without proj.weight_scales"),
    (lambda sd: sd.pop("head.weight_blocks"),
     "head.weight_scales [33, 3] comes without head.weight_blocks"),
    (lambda sd: sd.update(zip(("head.weight_blocks", "head.weight_scales"), quantize(torch.randn(33, 64)))),
     ("head.weight_blocks [33, 2, 16] + head.weight_scales [33, 2] do not fit Linear head with weight [33, 96]: "
      "it needs blocks [33, 3, 16] and scales [33, 3]")),
    (lambda sd: sd.update({"head.weight_scales": torch.zeros(33, 2, dtype=torch.uint8)}),
     "head.weight_blocks [33, 3, 16] + head.weight_scales [33, 2] do not fit Linear head"),
    (lambda sd: sd.update({"proj.weight_blocks": sd["proj.weight_blocks"].to(torch.int8)}),
     "proj.weight_blocks / proj.weight_scales have dtypes torch.int8 / torch.uint8"),
    (lambda sd: sd.update({"extra.weight": torch.zeros(3)}),
     "state dict does not fit Tiny: unexpected tensors: extra.weight"),
    (lambda sd: sd.update(zip(("ghost.weight_blocks", "ghost.weight_scales"), quantize(torch.randn(4, 32)))),
     "unexpected tensors: ghost.weight_blocks, ghost.weight_scales"),
    (lambda sd: sd.update({"proj.weight": torch.zeros(96, 64)}),  # both float and packed
     "unexpected tensors: proj.weight"),
    (lambda sd: sd.pop("norm.weight"),
     "state dict does not fit Tiny: missing tensors: norm.weight"),
])
def test_strict_errors_name_the_tensor(edit, message):
    fresh = Tiny()
    before = {name: t.clone() for name, t in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        load_weights(fresh, broken(edit))
    # Checked before anything is touched: no linear swapped, no tensor loaded.
    assert not any(isinstance(m, MXFP4Linear) for m in fresh.modules())
    assert all(torch.equal(t, before[name]) for name, t in fresh.state_dict().items())


def test_not_strict_tolerates_missing_and_unexpected_names():
    packed = broken(lambda sd: (sd.pop("norm.weight"), sd.update({"extra.weight": torch.zeros(3)})))
    fresh = Tiny()
    norm_before = fresh.norm.weight.clone()
    assert load_weights(fresh, packed, strict=False).num_mxfp4_linears == 2
    assert torch.equal(fresh.norm.weight, norm_before)
    with pytest.raises(ValueError, match="comes without proj.weight_scales"):  # a half pair never loads
        load_weights(Tiny(), broken(lambda sd: sd.pop("proj.weight_scales")), strict=False)


@pytest.mark.gpu  # the Triton path; tests/conftest.py skips it without a device
def test_gpu_forward_matches_cpu():
    layer = packed_layer(781, 1824, bias=True)
    x = torch.randn(5, 13, 1824, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = layer(x)
        actual = layer.cuda()(x.cuda()).cpu()
        actual_bf16 = layer(x.cuda().bfloat16()).float().cpu()
    assert relative_rms(actual, expected) < 1e-5  # fp32 products, only the summation order differs
    assert relative_rms(actual_bf16, expected) < 2.0**-7  # bf16 activations and output
