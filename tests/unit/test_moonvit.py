"""MoonViT-V2: parameter count, packed = per-image loop, equivalence with vLLM's own MoonViT3d on the
same weights, checkpoint loading by the checkpoint's names (float, or MXFP4 linears as shipped), and
the embedded encoder."""

from __future__ import annotations

import dataclasses
import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import moonserve.pipeline.prepare.vision_encoder
import moonserve.pipeline.models.moonvit
import moonserve.pipeline.models.moonvit_checkpoint
from moonserve.kernels.checks import relative_rms
from moonserve.kernels.mxfp4 import MXFP4Linear, dequantize, quantize, quantize_linear_weights
from moonserve.pipeline.prepare.vision_encoder import (
    embedded_encoder_config,
    load_embedded_encoder,
    random_state_dict,
    write_embedded_encoder,
)
from moonserve.pipeline.models.moonvit import (
    MoonViT,
    MoonViTConfig,
    merged_token_counts,
    parameter_count,
)
from moonserve.pipeline.models.moonvit_checkpoint import CheckpointMismatchError, load_moonvit

REPO = Path(__file__).resolve().parents[2]
# Small but with every production trait: qkv width != hidden, several heads, a non-square position
# table (so h/w mix-ups show), no biases, rmsnorm, 2x2 merge, patchmergerv2.
SMALL = MoonViTConfig(vt_hidden_size=64, vt_num_attention_heads=2, qkv_hidden_size=96, vt_intermediate_size=128,
                      vt_num_hidden_layers=2, init_pos_emb_height=8, init_pos_emb_width=6, text_hidden_size=40)
# [1, 8, 6] is the table's own size (no interpolation); [2, 4, 4] is a 2-frame video (time table,
# frame pooling); the rest are resized up or down.
GRIDS = [[1, 4, 6], [1, 8, 6], [1, 2, 2], [2, 4, 4], [1, 10, 14]]


def small_model(seed: int = 0, backend: str = "auto") -> MoonViT:
    model = MoonViT(SMALL, attention_backend=backend)
    model.load_state_dict(random_state_dict(SMALL, seed))
    return model.eval()


def pixel_values_for(grids: list[list[int]], seed: int = 1) -> torch.Tensor:
    total = sum(t * h * w for t, h, w in grids)
    return torch.randn(total, 3, 14, 14, generator=torch.Generator().manual_seed(seed))  # [total_patches, 3, 14, 14]


def test_docstring_examples_run():
    assert doctest.testmod(moonserve.pipeline.models.moonvit).failed == 0
    assert doctest.testmod(moonserve.pipeline.models.moonvit_checkpoint).failed == 0
    assert doctest.testmod(moonserve.pipeline.prepare.vision_encoder).failed == 0


def test_parameter_count_at_the_production_config():
    """The brief's 401M is the vision tower alone: 401,214,464 = 27 layers x 14,682,112 (wqkv 1024x4608,
    wo 1536x1024, MLP 2x 1024x4096, two norms) + patch projection 602,112 + 64x64x1024 position table
    + final norm. The patchmergerv2 projector (4096x4096 + 4096 x text_hidden_size + a norm) is counted
    apart: it depends on the LM (26.2M at KimiK3VisionConfig's default text_hidden_size of 2304)."""
    count = parameter_count(MoonViTConfig())
    print(f"MoonViT-V2: vision tower {count.vision_tower:,}, projector {count.mm_projector:,}, total {count.total:,}")
    assert count.vision_tower == 401_214_464
    assert abs(count.vision_tower / 401e6 - 1) < 0.01
    assert count.mm_projector == 4096 * 4096 + 4096 * 2304 + 2304


def test_packed_batch_equals_per_image_loop():
    model = small_model()
    pixel_values = pixel_values_for(GRIDS)
    with torch.inference_mode():
        packed = model(pixel_values, torch.tensor(GRIDS))
        offsets = torch.tensor([0] + [t * h * w for t, h, w in GRIDS]).cumsum(0).tolist()
        alone = [model(pixel_values[a:b], [grid])[0] for a, b, grid in zip(offsets, offsets[1:], GRIDS)]
    assert [e.shape[0] for e in packed] == merged_token_counts(GRIDS, SMALL) == [6, 12, 1, 4, 35]
    for i, (p, a) in enumerate(zip(packed, alone)):
        assert torch.allclose(p, a, rtol=1e-5, atol=1e-5), f"image {i}: max error {(p - a).abs().max().item()}"


def test_attention_backends_agree_through_the_model():
    pixel_values = pixel_values_for(GRIDS)
    with torch.inference_mode():
        naive = torch.cat(small_model(backend="naive")(pixel_values, GRIDS))
        sdpa = torch.cat(small_model(backend="sdpa")(pixel_values, GRIDS))
    assert relative_rms(sdpa, naive) < 1e-6


def test_flattened_pixel_values_are_accepted():
    model = small_model()
    pixel_values = pixel_values_for([[1, 4, 6]])
    with torch.inference_mode():
        assert torch.equal(model(pixel_values, [[1, 4, 6]])[0], model(pixel_values.flatten(1), [[1, 4, 6]])[0])


@pytest.mark.parametrize("grid, message", [
    ([[1, 4, 5]], "multiples of the 2x2 merge kernel"),
    ([[1, 4, 8]], "grid_thw covers 32 patches but pixel_values has 24"),
    ([[5, 2, 2]], r"need 1 <= t <= 4"),
    ([[1, 514, 2]], r"1 <= h, w <= 512"),
])
def test_bad_grid_thw_is_named(grid, message):
    with pytest.raises(ValueError, match=message):
        small_model()(pixel_values_for([[1, 4, 6]]), grid)


def test_bad_pixel_values_are_named():
    with pytest.raises(ValueError, match=r"pixel_values must be \[total_patches, 3, 14, 14\] .* got \[24, 3, 16, 16\]"):
        small_model()(torch.randn(24, 3, 16, 16), [[1, 4, 6]])


def test_config_from_a_kimi_k3_config_json():
    data = {"model_type": "kimi_k3", "text_config": {"hidden_size": 7168},
            "vision_config": {"model_type": "kimi_k3_vision", "vt_hidden_size": 1024, "merge_kernel_size": [2, 2],
                              "text_hidden_size": 2304, "transformers_version": "4.57"}}
    cfg = MoonViTConfig.from_dict(data)
    assert cfg.text_hidden_size == 7168  # KimiK3Config overrides it with text_config.hidden_size
    assert cfg.merge_kernel_size == (2, 2) and cfg.head_dim == 128
    assert MoonViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="MoonViTConfig.norm_type='batchnorm' is not supported"):
        MoonViTConfig(norm_type="batchnorm")


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    return path


def test_checkpoint_round_trip_by_checkpoint_names(tmp_path):
    state = random_state_dict(SMALL, seed=3)
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in state and "mm_projector.proj.2.weight" in state
    lm_tensor = {"language_model.model.embed_tokens.weight": torch.zeros(10, 4)}  # not the encoder's; never read
    write_checkpoint(tmp_path / "model-00001.safetensors", {**state, **lm_tensor})
    model = load_moonvit(tmp_path, SMALL)
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert not any(p.requires_grad for p in model.parameters())


def test_vllm_spelling_of_the_projector_loads_too(tmp_path):
    state = random_state_dict(SMALL, seed=3)
    renamed = {name.replace("proj.0", "linear_1").replace("proj.2", "linear_2"): t for name, t in state.items()}
    assert "mm_projector.linear_1.weight" in renamed
    loaded = load_moonvit(write_checkpoint(tmp_path / "model.safetensors", renamed), SMALL).state_dict()
    assert torch.equal(loaded["mm_projector.proj.2.weight"], state["mm_projector.proj.2.weight"])


def test_checkpoint_mismatches_are_named(tmp_path):
    state = random_state_dict(SMALL, seed=3)
    state["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(64, 64)
    del state["mm_projector.post_norm.weight"]
    state["vision_tower.encoder.blocks.2.wqkv.weight"] = torch.zeros(288, 64)
    path = write_checkpoint(tmp_path / "model.safetensors", state)
    with pytest.raises(CheckpointMismatchError) as error:
        load_moonvit(path, SMALL)
    message = str(error.value)
    assert "tensor vision_tower.encoder.blocks.0.wo.weight has shape [64, 64], the config needs [64, 96]" in message
    assert "missing tensor mm_projector.post_norm.weight [40]" in message
    assert "unexpected tensor vision_tower.encoder.blocks.2.wqkv.weight [288, 64]" in message


def test_quantized_tensors_are_refused_by_name(tmp_path):
    state = random_state_dict(SMALL, seed=3)
    state["vision_tower.encoder.blocks.0.mlp.fc0.weight"] = torch.zeros(128, 64, dtype=torch.uint8)
    with pytest.raises(CheckpointMismatchError, match=re.escape("blocks.0.mlp.fc0.weight has dtype torch.uint8")):
        load_moonvit(write_checkpoint(tmp_path / "model.safetensors", state), SMALL)


# Linear biases on too, so that MXFP4Linear's bias is loaded and used.
SMALL_BIASED = dataclasses.replace(SMALL, attn_bias=True, linear_bias=True)
NUM_LINEARS = 4 * SMALL.vt_num_hidden_layers + 2  # wqkv, wo, fc0, fc1 per layer; proj.0, proj.2


def dequantized(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float state dict an MXFP4 one stands for: each X_blocks + X_scales pair decoded to X."""
    state = {name: t for name, t in packed.items() if not name.endswith(("_blocks", "_scales"))}
    for name, blocks in packed.items():
        if name.endswith("_blocks"):
            weight = name.removesuffix("_blocks")
            state[weight] = dequantize(blocks, packed[weight + "_scales"])
    return state


def float_model(cfg: MoonViTConfig, state: dict[str, torch.Tensor]) -> MoonViT:
    model = MoonViT(cfg)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("cfg", [SMALL, SMALL_BIASED], ids=["no-bias", "bias"])
def test_mxfp4_checkpoint_runs_through_mxfp4_linears(tmp_path, cfg):
    state = random_state_dict(cfg, seed=3)
    packed = quantize_linear_weights(state)  # every nn.Linear weight; the patch conv (4-D) stays float
    model = load_moonvit(write_checkpoint(tmp_path / "model.safetensors", packed), cfg)
    # Really MXFP4 (a loader that dequantized on the way in would leave nn.Linear here).
    assert sum(isinstance(m, MXFP4Linear) for m in model.modules()) == NUM_LINEARS
    assert not any(type(m) is nn.Linear for m in model.modules())
    loaded = model.state_dict()
    assert loaded.keys() == packed.keys() and all(torch.equal(loaded[name], packed[name]) for name in packed)
    pixel_values = pixel_values_for(GRIDS)
    with torch.inference_mode():
        actual = torch.cat(model(pixel_values, GRIDS))
        on_dequantized = torch.cat(float_model(cfg, dequantized(packed))(pixel_values, GRIDS))
        on_float = torch.cat(float_model(cfg, state)(pixel_values, GRIDS))
    # What it computes: the float model on the dequantized weights, up to float32 summation order.
    assert relative_rms(actual, on_dequantized) < 1e-6
    # Quantization error against the float weights. Each linear's weight comes back with relative RMS
    # error 0.113-0.122 (Gaussian weights, as test_mxfp4); the projector alone chains two linears
    # with no residual, sqrt(2) * 0.115 = 0.16, and the 8 encoder linears add theirs through the
    # residual stream. Measured 0.21-0.23 over seeds 0-3 with and without biases; 0.3 leaves
    # margin, while swapped nibbles give 1.2-1.3 and every scale one code off 0.62-1.0 (seeds 0-2).
    error = relative_rms(actual, on_float)
    print(f"MoonViT ({'bias' if cfg.linear_bias else 'no bias'}), MXFP4 linears vs float: relative RMS {error:.3f}")
    assert error < 0.3


def test_mxfp4_checkpoint_in_bfloat16_with_e8m0_scales_and_vllm_names(tmp_path):
    packed = quantize_linear_weights(random_state_dict(SMALL, seed=3))
    shipped = {name.replace("proj.0", "linear_1").replace("proj.2", "linear_2"):
               t.view(torch.float8_e8m0fnu) if name.endswith("_scales") else t for name, t in packed.items()}
    assert "mm_projector.linear_1.weight_blocks" in shipped
    path = write_checkpoint(tmp_path / "model.safetensors", shipped)  # safetensors F8_E8M0 scales
    model = load_moonvit(path, SMALL, dtype=torch.bfloat16)
    wqkv = model.vision_tower.encoder.blocks[0].wqkv
    assert isinstance(wqkv, MXFP4Linear) and isinstance(model.mm_projector.proj[0], MXFP4Linear)
    assert wqkv.weight_blocks.dtype == wqkv.weight_scales.dtype == torch.uint8  # not cast to bf16
    assert torch.equal(wqkv.weight_scales, packed["vision_tower.encoder.blocks.0.wqkv.weight_scales"])
    assert model.vision_tower.encoder.blocks[0].norm0.weight.dtype == torch.bfloat16
    pixel_values = pixel_values_for(GRIDS)
    with torch.inference_mode():
        actual = torch.cat(model(pixel_values, GRIDS))
        in_float32 = torch.cat(float_model(SMALL, dequantized(packed))(pixel_values, GRIDS))
    assert actual.dtype == torch.bfloat16
    # bf16 activations through 10 linears and 2 attentions: measured 0.008.
    assert relative_rms(actual, in_float32) < 0.03


def test_mxfp4_checkpoint_mismatches_are_named(tmp_path):
    packed = quantize_linear_weights(random_state_dict(SMALL, seed=3))
    layer0, layer1 = "vision_tower.encoder.blocks.0.", "vision_tower.encoder.blocks.1."
    del packed[layer0 + "wo.weight_scales"]
    packed["mm_projector.proj.2.weight_blocks"], packed["mm_projector.proj.2.weight_scales"] = quantize(
        torch.randn(40, 128))
    pos_emb = "vision_tower.patch_embed.pos_emb.weight"
    packed[pos_emb + "_blocks"], packed[pos_emb + "_scales"] = quantize(packed.pop(pos_emb))
    packed[layer1 + "mlp.fc0.weight"] = torch.zeros(128, 64)
    packed[layer1 + "wqkv.weight_scales"] = packed[layer1 + "wqkv.weight_scales"].float()
    with pytest.raises(CheckpointMismatchError) as error:
        load_moonvit(write_checkpoint(tmp_path / "model.safetensors", packed), SMALL)
    message = str(error.value)
    assert (f"tensor {layer0}wo.weight_blocks [64, 3, 16] has no {layer0}wo.weight_scales: "
            "MXFP4 weights come as _blocks + _scales pairs") in message
    assert ("tensors mm_projector.proj.2.weight_blocks [40, 4, 16] + mm_projector.proj.2.weight_scales [40, 4] "
            "hold [40, 128], the config needs mm_projector.proj.2.weight [40, 256]") in message
    assert f"missing tensor {pos_emb} [8, 6, 64]" in message
    assert (f"unexpected tensors {pos_emb}_blocks [8, 6, 2, 16] + {pos_emb}_scales [8, 6, 2]: MoonViT takes "
            "MXFP4 pairs for linear weights only") in message
    assert f"tensor {layer1}mlp.fc0.weight comes both as a float tensor and as MXFP4" in message
    assert (f"tensors {layer1}wqkv.weight_blocks [288, 2, 16] + {layer1}wqkv.weight_scales [288, 2] have dtypes "
            "torch.uint8 + torch.float32") in message
    assert len(message.splitlines()) == 1 + 6  # the header, then one line per problem


def test_embedded_encoder_is_written_once_and_loads_with_the_checkpoint_loader(tmp_path):
    path = write_embedded_encoder(tmp_path)
    assert path == tmp_path / "models" / "moonvit-embedded"
    assert MoonViTConfig.from_pretrained(path) == embedded_encoder_config(576)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert write_embedded_encoder(tmp_path) == path and weights.stat().st_mtime_ns == stamp  # reused
    model = load_embedded_encoder(path)
    with torch.inference_mode():
        (embeddings,) = model(torch.randn(1024, 3, 14, 14), [[1, 32, 32]])  # one 448x448 image
    assert embeddings.shape == (256, 576) and embeddings.isfinite().all()
    assert not list(tmp_path.joinpath("models").glob(".moonvit-embedded-*"))  # no staging left behind


def test_embedded_encoder_is_deterministic_and_rebuilt_when_corrupted(tmp_path):
    first = load_file(write_embedded_encoder(tmp_path / "a") / "model.safetensors")
    path = write_embedded_encoder(tmp_path / "b")
    assert all(torch.equal(t, load_file(path / "model.safetensors")[name]) for name, t in first.items())
    (path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(FileNotFoundError, match="run `moonserve prepare`"):
        load_embedded_encoder(path)
    write_embedded_encoder(tmp_path / "b")
    assert load_embedded_encoder(path) is not None
    other = write_embedded_encoder(tmp_path / "b", seed=1)  # another seed is another build
    assert not torch.equal(load_file(other / "model.safetensors")["mm_projector.proj.0.weight"],
                           first["mm_projector.proj.0.weight"])


# vLLM's MoonViT3dPretrainedModel + KimiK25MultiModalProjector run in a child process: they need a
# vLLM config context and a (single-process, gloo) distributed init, which must not leak into this
# process. On CPU vLLM picks the TORCH_SDPA encoder attention and its torch rotary (no triton there).
def run_vllm_reference(workdir: Path) -> dict:
    """Entry point of the child: load workdir's checkpoint into vLLM's modules by the checkpoint's
    names (Kimi K3's own weight mapper), encode workdir's inputs, write the outputs."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.kimi_k25_vit import (
        KimiK25MultiModalProjector,
        MoonViT3dPretrainedModel,
        vision_tower_forward,
    )
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3VisionConfig

    config = json.loads((workdir / "config.json").read_text())
    config.pop("model_type")
    vision_config = KimiK3VisionConfig(**config)

    class KimiK3VisionParts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = MoonViT3dPretrainedModel(vision_config, prefix="vision_tower")
            self.mm_projector = KimiK25MultiModalProjector(
                vision_config, out_hidden_size=vision_config.text_hidden_size, prefix="mm_projector")

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{workdir / 'dist-init'}")
        initialize_model_parallel(1)
        parts = KimiK3VisionParts()
        loaded = AutoWeightsLoader(parts).load_weights(
            load_file(workdir / "model.safetensors").items(), mapper=KimiK3ForConditionalGeneration.hf_to_vllm_mapper)
        for module in parts.modules():  # what vLLM's loader does after loading (CPU GEMM dispatch)
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
        inputs = load_file(workdir / "inputs.safetensors")
        outputs = vision_tower_forward(parts.vision_tower, inputs["pixel_values"], inputs["grid_thw"],
                                       parts.mm_projector, use_data_parallel=False)
    save_file({f"image_{i}": out.contiguous() for i, out in enumerate(outputs)}, str(workdir / "vllm.safetensors"))
    return {"loaded": sorted(loaded), "parameters": sorted(name for name, _ in parts.named_parameters()),
            "attention": str(parts.vision_tower.encoder.blocks[0].attn.attn_backend)}


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory) -> dict:
    pytest.importorskip("vllm", reason="vllm is not installed; nothing to compare against")
    workdir = tmp_path_factory.mktemp("vllm-moonvit")
    save_file(random_state_dict(SMALL, seed=5), str(workdir / "model.safetensors"))
    (workdir / "config.json").write_text(json.dumps(SMALL.to_dict()))
    save_file({"pixel_values": pixel_values_for(GRIDS, seed=6), "grid_thw": torch.tensor(GRIDS)},
              str(workdir / "inputs.safetensors"))
    python_path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # Eager: vLLM torch.compiles its position-table resize with inductor, seconds of C++ builds for one op.
    env = {**os.environ, "PYTHONPATH": python_path, "TORCHDYNAMO_DISABLE": "1"}
    child = subprocess.run([sys.executable, __file__, str(workdir)], check=False, env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, f"vLLM reference child failed:\n{child.stderr[-4000:]}"
    return {"workdir": workdir, **json.loads(child.stdout.splitlines()[-1])}


def test_vllm_loads_every_tensor_by_our_names(vllm_reference):
    # Names the checkpoint would have (ours) reach every vLLM parameter through K3's weight mapper.
    assert vllm_reference["loaded"] == vllm_reference["parameters"]


def test_matches_vllm_moonvit_on_the_same_weights(vllm_reference):
    workdir = vllm_reference["workdir"]
    expected = load_file(workdir / "vllm.safetensors")
    model = load_moonvit(workdir)
    inputs = load_file(workdir / "inputs.safetensors")
    with torch.inference_mode():
        actual = model(inputs["pixel_values"], inputs["grid_thw"])
    assert len(actual) == len(expected) == len(GRIDS)
    for i, out in enumerate(actual):
        reference = expected[f"image_{i}"]
        assert out.shape == reference.shape
        max_error = (out - reference).abs().max().item() / reference.pow(2).mean().sqrt().item()
        print(f"image {i} grid {GRIDS[i]}: relative RMS {relative_rms(out, reference):.2e}, "
              f"max error / RMS {max_error:.2e} ({vllm_reference['attention']})")
        assert max_error <= 1e-4


if __name__ == "__main__":
    print(json.dumps(run_vllm_reference(Path(sys.argv[1]))))
