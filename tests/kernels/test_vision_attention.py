"""Varlen attention with 2D rotary: the naive spec checked from first principles, the SDPA torch path
against it, and the Triton kernel (interpreter) against it."""

from __future__ import annotations

import doctest

import pytest
import torch

from moonserve.kernels.checks import relative_rms
from moonserve.kernels.vision_attention import naive, sdpa, select_backend, varlen_attention
from moonserve.kernels.vision_attention.naive import cu_seqlens_from_grid_thw, rope_2d_cos_sin

# Sequence lengths 1, 63 and 200 packed: below, straddling and well past a 64-row tile.
GRIDS = [[1, 1, 1], [1, 7, 9], [1, 10, 20]]
HEAD_DIM = 128  # MoonViT-V2: qkv_hidden_size 1536 / 12 heads


def packed_qkv(grids: list[list[int]], heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one [total, 3, heads, head_dim] buffer (the model's layout), plus cu_seqlens, cos, sin."""
    total = sum(t * h * w for t, h, w in grids)
    qkv = torch.randn(total, 3, heads, head_dim, generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_2d_cos_sin(grids, head_dim)
    return (*qkv.unbind(1), cu_seqlens_from_grid_thw(grids), cos, sin)


def test_docstring_examples_run():
    import moonserve.kernels.vision_attention as package

    assert doctest.testmod(naive).failed == 0 and doctest.testmod(package).failed == 0


def test_cu_seqlens_and_angles_follow_grid_thw():
    assert cu_seqlens_from_grid_thw([[1, 2, 3], [2, 2, 2], [1, 1, 1]]).tolist() == [0, 6, 14, 15]
    angles = naive.rope_2d_angles([[1, 2, 3]], head_dim=8)  # [6, 4]; pairs: (x f0, y f0, x f1, y f1)
    f1 = 10000 ** (-4 / 8)
    row1_col2 = angles[1 * 3 + 2]
    assert torch.allclose(row1_col2, torch.tensor([2.0, 1.0, 2 * f1, 1 * f1]))
    video = naive.rope_2d_angles([[2, 2, 3]], head_dim=8)
    assert torch.equal(video[:6], angles) and torch.equal(video[6:], angles)  # frames share positions


def test_rotary_is_complex_multiplication_of_interleaved_pairs():
    # vLLM's definition: view (x[2j], x[2j + 1]) as a complex number and multiply by cis(angle_j).
    x = torch.randn(6, 2, 8)
    angles = naive.rope_2d_angles([[1, 2, 3]], head_dim=8)  # [6, 4]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (4, 2))) * torch.polar(
        torch.ones_like(angles), angles)[:, None, :]).flatten(-2)
    assert torch.allclose(naive.apply_rotary(x, angles.cos(), angles.sin()), expected, atol=1e-6)


def test_scores_depend_only_on_relative_2d_offsets():
    q, k = torch.randn(2, 1, 1, 16).unbind(0)
    cos, sin = rope_2d_cos_sin([[1, 8, 8]], head_dim=16)

    def score(query_pos: int, key_pos: int) -> float:
        rq = naive.apply_rotary(q, cos[query_pos:query_pos + 1], sin[query_pos:query_pos + 1])
        rk = naive.apply_rotary(k, cos[key_pos:key_pos + 1], sin[key_pos:key_pos + 1])
        return (rq * rk).sum().item()

    # (row 1, col 2) -> (row 3, col 3) and (row 4, col 4) -> (row 6, col 5): the same offset.
    assert score(1 * 8 + 2, 3 * 8 + 3) == pytest.approx(score(4 * 8 + 4, 6 * 8 + 5), rel=1e-5)
    assert score(1 * 8 + 2, 3 * 8 + 3) != pytest.approx(score(1 * 8 + 2, 3 * 8 + 4), rel=1e-3)


def test_attention_stays_within_each_image():
    q, k, v, cu_seqlens, cos, sin = packed_qkv(GRIDS, heads=2, head_dim=32)
    out = naive.varlen_attention(q, k, v, cu_seqlens, cos, sin)
    k2, v2 = k.clone(), v.clone()
    k2[64:], v2[64:] = torch.randn(200, 2, 32), torch.randn(200, 2, 32)  # change only the third image
    changed = naive.varlen_attention(q, k2, v2, cu_seqlens, cos, sin)
    assert torch.equal(out[:64], changed[:64]) and not torch.equal(out[64:], changed[64:])
    assert torch.allclose(out[0], v[0])  # a one-token image attends only to itself


@pytest.mark.parametrize("grids", [GRIDS, [[1, 4, 4]] * 3 + [[1, 2, 8]], [[1, 6, 6]]])
def test_sdpa_path_matches_naive(grids):
    q, k, v, cu_seqlens, cos, sin = packed_qkv(grids, heads=3, head_dim=HEAD_DIM)
    expected = naive.varlen_attention(q, k, v, cu_seqlens, cos, sin)
    assert relative_rms(sdpa.varlen_attention(q, k, v, cu_seqlens, cos, sin), expected) < 1e-6


def test_bad_inputs_are_named():
    q, k, v, cu_seqlens, cos, sin = packed_qkv(GRIDS, heads=2, head_dim=32)
    with pytest.raises(ValueError, match=r"cos and sin must be \[total_tokens, head_dim // 2\] = \(264, 16\)"):
        naive.varlen_attention(q, k, v, cu_seqlens, cos[:, :8], sin)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to total_tokens=264"):
        sdpa.varlen_attention(q, k, v, cu_seqlens[:-1], cos, sin)
    with pytest.raises(ValueError, match="unknown vision attention backend 'flash'"):
        varlen_attention(q, k, v, cu_seqlens, cos, sin, backend="flash")


def test_dispatcher_uses_the_torch_path_on_cpu():
    assert select_backend(torch.device("cpu")) == "sdpa"
    assert select_backend(torch.device("cpu"), "naive") == "naive"


# The Triton cases run in a TRITON_INTERPRET=1 child (conftest.py: `triton_results`), in float32
# only: the interpreter's bf16 tl.dot is wrong; gpu_check.py covers bf16.
# (grids, heads, head_dim): the production head_dim; the embedded encoder's 64; 40, which pads to 64.
TRITON_CASES = [(GRIDS, 2, HEAD_DIM), ([[1, 4, 4], [1, 2, 2], [1, 6, 4]], 2, 64), ([[1, 3, 5], [1, 1, 2]], 1, 40)]


def run_triton_case(vision_triton, grids: list[list[int]], heads: int, head_dim: int) -> dict:
    q, k, v, cu_seqlens, cos, sin = packed_qkv(grids, heads, head_dim, seed=7)
    poisoned = torch.full(q.shape, float("nan"))  # unwritten elements stay NaN
    actual = vision_triton.varlen_attention(q, k, v, cu_seqlens, cos, sin, out=poisoned)
    expected = naive.varlen_attention(q, k, v, cu_seqlens, cos, sin)
    return {"unwritten": int(actual.isnan().sum()), "relative_rms": relative_rms(actual.nan_to_num(), expected)}


def run_triton_cases() -> dict:
    """Entry point of the TRITON_INTERPRET=1 child: every Triton case, as JSON-able results."""
    from triton.runtime.interpreter import InterpretedFunction

    from moonserve.kernels.vision_attention import triton as vision_triton

    return {
        "interpreted": isinstance(vision_triton._varlen_rope_attention_kernel, InterpretedFunction),
        "cases": {str(case): run_triton_case(vision_triton, *case) for case in TRITON_CASES},
    }


def test_triton_kernel_runs_in_the_interpreter(triton_results):
    assert triton_results["interpreted"]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_naive(triton_results, case):
    result = triton_results["cases"][str(case)]
    assert result["unwritten"] == 0
    assert result["relative_rms"] <= 1e-5


def test_triton_wrapper_rejects_what_naive_rejects():
    # Checks happen before any launch, so this runs in this process, interpreter or not.
    vision_triton = pytest.importorskip("moonserve.kernels.vision_attention.triton", reason="triton is not installed")
    q, k, v, cu_seqlens, cos, sin = packed_qkv(GRIDS, heads=2, head_dim=32)
    with pytest.raises(ValueError, match=r"q, k, v must all be \[total_tokens, num_heads, head_dim\]"):
        vision_triton.varlen_attention(q, k[:10], v, cu_seqlens, cos, sin)
    with pytest.raises(ValueError, match="out must be"):
        vision_triton.varlen_attention(q, k, v, cu_seqlens, cos, sin, out=torch.empty(3, 2, 32))
