"""MoonViT-V2, the Kimi K3 vision encoder, in plain PyTorch: packed images in, LM-sized embeddings out.

Mirrors vLLM's ``MoonViT3dPretrainedModel`` + ``KimiK25MultiModalProjector`` (vllm/model_executor/
models/kimi_k25_vit.py) configured by ``KimiK3VisionConfig`` (vllm/transformers_utils/configs/
kimi_k3.py): a 14x14 patch projection plus an interpolated learnable 2D position table, pre-norm
encoder layers whose attention uses interleaved 2D rotary and never crosses an image boundary, a
final RMSNorm, a 2x2 patch merge, and the ``patchmergerv2`` projector to the text hidden size.

Parameter names are the checkpoint's (``vision_tower.encoder.blocks.0.wqkv.weight``,
``mm_projector.proj.0.weight``, ...), so a Kimi K3 checkpoint's vision tensors load as they are:
``moonserve.pipeline.models.moonvit_checkpoint.load_moonvit`` reads, checks and loads them, linear
weights shipped as MXFP4 pairs included.

Example:
    >>> import torch
    >>> from moonserve.pipeline.models.moonvit import MoonViT, MoonViTConfig
    >>> cfg = MoonViTConfig(vt_hidden_size=64, vt_num_attention_heads=2, qkv_hidden_size=64,
    ...                     vt_intermediate_size=128, vt_num_hidden_layers=1, text_hidden_size=48)
    >>> model = MoonViT(cfg).eval()
    >>> grid_thw = torch.tensor([[1, 4, 6], [1, 2, 2]])  # two images: 24 and 4 patches
    >>> pixel_values = torch.randn(28, 3, 14, 14)  # [total_patches, 3, 14, 14]
    >>> [e.shape for e in model(pixel_values, grid_thw)]  # 2x2 merge: 6 and 1 tokens
    [torch.Size([6, 48]), torch.Size([1, 48])]
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moonserve.kernels.vision_attention import (
    Backend,
    cu_seqlens_from_grid_thw,
    rope_2d_cos_sin,
    varlen_attention,
)
from moonserve.pipeline.models.weights import CONFIG_FILE

IN_CHANNELS = 3
# Rope2DPosEmbRepeated(head_dim, 512, 512) in vLLM: the largest grid, in patches, on either side.
ROPE_MAX_GRID = 512
ROPE_THETA = 10000.0
SUPPORTED = {
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic"),
    "norm_type": ("rmsnorm", "layernorm"),
    "mlp_type": ("mlp2",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmergerv2",),
    "video_attn_type": ("spatial_temporal",),
    "activation_func": ("gelu_pytorch_tanh", "gelu"),
    "projector_hidden_act": ("gelu",),
}


@dataclass(frozen=True)
class MoonViTConfig:
    """KimiK3VisionConfig's fields, production values as defaults (vllm 0.32).

    ``text_hidden_size`` is the LM's hidden size (KimiK3Config sets it from text_config.hidden_size;
    2304 is KimiK3VisionConfig's own default).
    """

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    video_attn_type: str = "spatial_temporal"
    mm_projector_type: str = "patchmergerv2"
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    patch_embed_proj_bias: bool = False
    mlp_type: str = "mlp2"
    linear_bias: bool = False
    activation_func: str = "gelu_pytorch_tanh"
    text_hidden_size: int = 2304

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge_kernel_size", tuple(self.merge_kernel_size))
        for name, allowed in SUPPORTED.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoonViTConfig.{name}={getattr(self, name)!r} is not supported; use one of {allowed}")
        heads = self.vt_num_attention_heads
        if self.qkv_hidden_size % heads or (self.qkv_hidden_size // heads) % 4:
            raise ValueError(f"MoonViTConfig.qkv_hidden_size={self.qkv_hidden_size} must split into "
                             f"vt_num_attention_heads={heads} heads of a head_dim divisible by 4 (2D rotary)")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: kh * kw patches of vt_hidden_size."""
        return self.vt_hidden_size * math.prod(self.merge_kernel_size)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoonViTConfig:
        """From a KimiK3VisionConfig dict, or a whole Kimi K3 config.json (vision_config + text_config).

        Keys that are not MoonViTConfig fields (model_type, transformers_version, ...) are ignored.
        """
        vision = dict(data.get("vision_config", data))
        text_hidden = data.get("text_config", {}).get("hidden_size")
        if text_hidden is not None:  # KimiK3Config overrides the vision config's value with it
            vision["text_hidden_size"] = text_hidden
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in vision.items() if key in names})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MoonViTConfig:
        """From the config.json in a checkpoint directory."""
        return cls.from_dict(json.loads((Path(path) / CONFIG_FILE).read_text()))

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "kimi_k3_vision", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class EncoderMetadata:
    """What every encoder layer needs about the packed batch, built once per forward."""

    cu_seqlens: torch.Tensor  # int32 [num_images + 1]
    cos: torch.Tensor  # float32 [total_patches, head_dim // 2]
    sin: torch.Tensor  # float32 [total_patches, head_dim // 2]
    max_seqlen: int
    attention_backend: Backend


def check_grid_thw(grid_thw: torch.Tensor | list[list[int]], cfg: MoonViTConfig, num_patches: int) -> list[list[int]]:
    """grid_thw as a list of [t, h, w], after checking it against cfg and the number of patches."""
    grids = torch.as_tensor(grid_thw).reshape(-1, 3).tolist() if len(grid_thw) else []
    kh, kw = cfg.merge_kernel_size
    for i, (t, h, w) in enumerate(grids):
        if not (1 <= t <= cfg.init_pos_emb_time and 1 <= h <= ROPE_MAX_GRID and 1 <= w <= ROPE_MAX_GRID):
            raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: need 1 <= t <= {cfg.init_pos_emb_time} and "
                             f"1 <= h, w <= {ROPE_MAX_GRID} patches")
        if h % kh or w % kw:
            raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: h and w must be multiples of the "
                             f"{kh}x{kw} merge kernel")
    total = sum(t * h * w for t, h, w in grids)
    if total != num_patches:
        raise ValueError(f"grid_thw covers {total} patches but pixel_values has {num_patches}")
    return grids


def check_pixel_values(pixel_values: torch.Tensor, cfg: MoonViTConfig) -> None:
    """Raise a ValueError unless pixel_values is [total_patches, 3, P, P] or [total_patches, 3 * P * P]."""
    p = cfg.patch_size
    if tuple(pixel_values.shape[1:]) not in ((IN_CHANNELS, p, p), (IN_CHANNELS * p * p,)):
        raise ValueError(f"pixel_values must be [total_patches, {IN_CHANNELS}, {p}, {p}] or "
                         f"[total_patches, {IN_CHANNELS * p * p}], got {list(pixel_values.shape)}")


def merged_token_counts(grid_thw: list[list[int]], cfg: MoonViTConfig) -> list[int]:
    """Output tokens per image: (h / kh) * (w / kw); frames of a video are averaged into one."""
    kh, kw = cfg.merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in grid_thw]


def make_norm(norm_type: str, dim: int) -> nn.Module:
    # eps=None, as vLLM's _make_vision_norm: RMSNorm then uses finfo(dtype).eps of its input.
    return nn.RMSNorm(dim) if norm_type == "rmsnorm" else nn.LayerNorm(dim)


def sincos_time_embedding(dim: int, num_frames: int) -> torch.Tensor:
    """[num_frames, 1, dim] fixed 1D sin-cos table (MAE's get_1d_sincos_pos_embed), added per frame."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0))  # [dim // 2]
    angles = torch.outer(torch.arange(num_frames, dtype=torch.float32), omega)  # [num_frames, dim // 2]
    return torch.cat([angles.sin(), angles.cos()], dim=1).unsqueeze(1)


class DividedFixedPosEmb(nn.Module):
    """Learnable [H, W, dim] table resized to each image's grid, plus a fixed sin-cos table over time."""

    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        self.interpolation_mode = cfg.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size))
        nn.init.normal_(self.weight)  # as vLLM; a checkpoint overwrites it

    def grid_embedding(self, h: int, w: int) -> torch.Tensor:
        """[h * w, dim]: the table itself at its own size, else resized (F.interpolate, as vLLM)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(end_dim=1)
        table = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, dim, H, W]
        resized = F.interpolate(table, size=(h, w), mode=self.interpolation_mode)  # [1, dim, h, w]
        return resized.squeeze(0).permute(1, 2, 0).flatten(end_dim=1)

    def forward(self, grid_thw: list[list[int]]) -> torch.Tensor:
        """[total_patches, dim]; each distinct (h, w) is resized once per call."""
        resized = {(h, w): self.grid_embedding(h, w) for _, h, w in grid_thw}
        parts = []
        for t, h, w in grid_thw:
            frame = resized[(h, w)]  # [h * w, dim]
            if t > 1:
                time = sincos_time_embedding(frame.shape[-1], t).to(frame)  # [t, 1, dim]
                frame = (frame.unsqueeze(0) + time).flatten(end_dim=1)
            parts.append(frame)
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    """pixel_values [total_patches, 3, P, P] -> [total_patches, hidden] with position embeddings added."""

    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(IN_CHANNELS, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = DividedFixedPosEmb(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        # A stride-P PxP conv over one PxP patch is a matmul over its flattened (c, y, x) values.
        weight = self.proj.weight.flatten(1)  # [hidden, 3 * P * P]
        x = F.linear(pixel_values.flatten(1).to(weight.dtype), weight, self.proj.bias)  # [total_patches, hidden]
        return x + self.pos_emb(grid_thw)


class MLP2(nn.Module):
    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=cfg.linear_bias)
        self.approximate = "tanh" if cfg.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    """Pre-norm block: x + wo(attn(rotary(wqkv(norm0(x))))), then x + mlp(norm1(x))."""

    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = make_norm(cfg.norm_type, cfg.vt_hidden_size)
        self.norm1 = make_norm(cfg.norm_type, cfg.vt_hidden_size)
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.qkv_hidden_size, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.vt_hidden_size, bias=cfg.attn_bias)
        self.mlp = MLP2(cfg)

    def attention(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)  # [total, 3, heads, head_dim]
        q, k, v = qkv.unbind(1)
        out = varlen_attention(q, k, v, meta.cu_seqlens, meta.cos, meta.sin,
                               max_seqlen=meta.max_seqlen, backend=meta.attention_backend)
        return self.wo(out.reshape(x.shape[0], -1))  # [total, hidden]

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), meta)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = make_norm(cfg.norm_type, cfg.vt_hidden_size)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, meta)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grid_thw: list[list[int]], kernel: tuple[int, int]) -> torch.Tensor:
    """[total_patches, hidden] -> [total_merged, kh * kw * hidden]: each kh x kw window of patches
    becomes one token (row-major within the window), frames averaged (vLLM's tpool_patch_merger)."""
    kh, kw = kernel
    parts = []
    for seq, (t, h, w) in zip(x.split([t * h * w for t, h, w in grid_thw]), grid_thw):
        windows = seq.view(t, h // kh, kh, w // kw, kw, -1).mean(dim=0)  # [h / kh, kh, w / kw, kw, hidden]
        parts.append(windows.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1))
    return torch.cat(parts)


class VisionTower(nn.Module):
    """The checkpoint's ``vision_tower``: patch embedding, encoder, patch merge."""

    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def prepare_metadata(self, grid_thw: list[list[int]], device: torch.device, backend: Backend) -> EncoderMetadata:
        cos, sin = rope_2d_cos_sin(grid_thw, self.config.head_dim, ROPE_THETA)
        return EncoderMetadata(cu_seqlens=cu_seqlens_from_grid_thw(grid_thw).to(device),
                               cos=cos.to(device), sin=sin.to(device),
                               max_seqlen=max((t * h * w for t, h, w in grid_thw), default=0),
                               attention_backend=backend)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]], backend: Backend = "auto") -> torch.Tensor:
        """pixel_values [total_patches, 3, P, P] -> merged tokens [total_merged, kh * kw * hidden]."""
        meta = self.prepare_metadata(grid_thw, pixel_values.device, backend)
        x = self.patch_embed(pixel_values, grid_thw)  # [total_patches, hidden]
        x = self.encoder(x, meta)
        return merge_patches(x, grid_thw, self.config.merge_kernel_size)


class PatchMergerV2Projector(nn.Module):
    """The checkpoint's ``mm_projector``: Linear, GELU, Linear (``proj.0``, ``proj.2``), then RMSNorm."""

    def __init__(self, cfg: MoonViTConfig):
        super().__init__()
        width = cfg.merged_hidden_size
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, cfg.text_hidden_size, bias=False))
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))  # [total_merged, text_hidden_size]


class MoonViT(nn.Module):
    """Vision tower + projector, randomly initialized (torch defaults); moonvit_checkpoint.load_moonvit
    loads a checkpoint."""

    def __init__(self, cfg: MoonViTConfig, attention_backend: Backend = "auto"):
        super().__init__()
        self.config = cfg
        self.attention_backend = attention_backend
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = PatchMergerV2Projector(cfg)

    def embed_packed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        """Embeddings of every image, back to back: [sum of merged_token_counts, text_hidden_size].

        pixel_values: [total_patches, 3, P, P] (or flattened [total_patches, 3 * P * P]), the patches
        of each image row-major, images back to back; grid_thw: [num_images, 3] in patches.
        """
        check_pixel_values(pixel_values, self.config)
        grids = check_grid_thw(grid_thw, self.config, pixel_values.shape[0])
        if not grids:
            return pixel_values.new_empty(0, self.config.text_hidden_size)
        merged = self.vision_tower(pixel_values, grids, self.attention_backend)  # [total_merged, kh*kw*hidden]
        return self.mm_projector(merged)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> list[torch.Tensor]:
        """Per-image embeddings [(h / kh) * (w / kw), text_hidden_size], attention kept within each image."""
        grids = check_grid_thw(grid_thw, self.config, pixel_values.shape[0])
        return list(self.embed_packed(pixel_values, grids).split(merged_token_counts(grids, self.config)))


class ParameterCount(NamedTuple):
    vision_tower: int
    mm_projector: int

    @property
    def total(self) -> int:
        return self.vision_tower + self.mm_projector


def build_on_meta(cfg: MoonViTConfig) -> MoonViT:
    """The model with every tensor on the meta device: shapes without memory."""
    with torch.device("meta"):
        return MoonViT(cfg)


def parameter_count(cfg: MoonViTConfig = MoonViTConfig()) -> ParameterCount:
    """Parameters of the vision tower and of the projector, counted on the meta device.

    >>> parameter_count().vision_tower
    401214464
    """
    model = build_on_meta(cfg)
    parts = (model.vision_tower, model.mm_projector)
    return ParameterCount(*(sum(p.numel() for p in part.parameters()) for part in parts))


def expected_tensor_shapes(cfg: MoonViTConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for this config (the model's state dict names)."""
    return {name: tuple(t.shape) for name, t in build_on_meta(cfg).state_dict().items()}


def linear_weight_names(cfg: MoonViTConfig) -> set[str]:
    """Names of the nn.Linear weights: those a checkpoint may ship as MXFP4 _blocks + _scales pairs."""
    return {f"{name}.weight" for name, m in build_on_meta(cfg).named_modules() if isinstance(m, nn.Linear)}
