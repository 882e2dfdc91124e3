"""The embedded vision encoder: a small, seeded, random MoonViT-V2 for machines without the real one.

Same architecture and checkpoint names as the production encoder (14x14 patches, 64x64 position
table, 2D rotary, 2x2 merge, patchmergerv2 projector), narrower and shallower: hidden 96, 2 heads of
64, 2 layers, projecting to the embedded LM's hidden size (576, SmolLM2-135M). Its weights are random,
so its embeddings carry no meaning; it exists so that the image path runs end to end on a CPU and
so that the production loader (moonserve.pipeline.models.moonvit_checkpoint.load_moonvit) is what loads it.

Written under ``$MOONSERVE_HOME/models/moonvit-embedded/`` as ``model.safetensors`` + ``config.json``
+ a SHA-256 manifest (a `store.Artifact`); a directory whose manifest matches (files, seed, config)
is reused.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as home:
    ...     model = load_embedded_encoder(write_embedded_encoder(Path(home)))
    >>> [e.shape for e in model(torch.randn(1024, 3, 14, 14), [[1, 32, 32]])]  # one 448x448 image
    [torch.Size([256, 576])]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from moonserve.pipeline.models.moonvit import MoonViT, MoonViTConfig, expected_tensor_shapes
from moonserve.pipeline.models.moonvit_checkpoint import load_moonvit
from moonserve.pipeline.prepare.store import CONFIG_FILE, WEIGHTS_FILE, Artifact

# Bump the version whenever the architecture or the initialization changes.
EMBEDDED_ENCODER = Artifact("moonvit-embedded", format_version=1)


def embedded_encoder_config(text_hidden_size: int = 576) -> MoonViTConfig:
    """The production config, narrowed: hidden 96, 2 heads x 64 (qkv 128), MLP 384, 2 layers.

    qkv_hidden_size != vt_hidden_size as in production (1536 vs 1024), so wo is not square.
    """
    return MoonViTConfig(vt_hidden_size=96, vt_num_attention_heads=2, qkv_hidden_size=128,
                         vt_intermediate_size=384, vt_num_hidden_layers=2, text_hidden_size=text_hidden_size)


def embedded_encoder_dir(home: Path | None = None) -> Path:
    return EMBEDDED_ENCODER.path(home)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm scales near 1, a small position table, linear/conv weights with std 1/sqrt(fan_in)."""
    noise = torch.randn(shape, generator=generator)
    if len(shape) == 1:  # norm weights (the config has no biases)
        return 1.0 + 0.1 * noise
    if name.endswith("pos_emb.weight"):
        return 0.1 * noise
    return noise / math.sqrt(math.prod(shape[1:]))


def random_state_dict(cfg: MoonViTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every checkpoint tensor of cfg, drawn in sorted-name order."""
    generator = torch.Generator().manual_seed(seed)
    shapes = expected_tensor_shapes(cfg)
    return {name: random_tensor(name, shapes[name], generator) for name in sorted(shapes)}


def build_encoder_dir(out_dir: Path, cfg: MoonViTConfig, seed: int) -> None:
    from safetensors.torch import save_file

    save_file(random_state_dict(cfg, seed), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))


def write_embedded_encoder(home: Path | None = None, text_hidden_size: int = 576, seed: int = 0,
                           artifact: Artifact = EMBEDDED_ENCODER) -> Path:
    """Build (or verify and reuse) the embedded encoder under home/models/moonvit-embedded; its path.

    About 4 MB (1.6 MB of it the 64x64 position table), under a second to build. An interrupted
    build never leaves a half-written directory in place; a corrupted one, or one of another seed or
    config, is rebuilt.
    """
    cfg = embedded_encoder_config(text_hidden_size)
    return artifact.ensure(home, lambda staging: build_encoder_dir(staging, cfg, seed),
                           seed=seed, config=cfg.to_dict())


def prepare_vision_encoder(lm_path: Path | str | None = None, home: Path | None = None) -> Path:
    """The embedded MoonViT (seeded random weights) projecting to the LM's hidden size; idempotent.
    For an LM other than the embedded one (the tiny test model) it has a folder of its own.

    Its weights are random: image requests take the real path, but the embedded model cannot see.
    """
    from moonserve.pipeline.prepare.language_model import embedded_lm_dir

    lm_dir = Path(lm_path or embedded_lm_dir(home))
    lm_config = json.loads((lm_dir / CONFIG_FILE).read_text())
    hidden = lm_config.get("text_config", lm_config)["hidden_size"]
    artifact = EMBEDDED_ENCODER.for_target(lm_dir, embedded_lm_dir(home))
    return write_embedded_encoder(home, text_hidden_size=hidden, artifact=artifact)


def load_embedded_encoder(path: Path, attention_backend: str = "auto") -> MoonViT:
    """The float32 MoonViT at path (as written by write_embedded_encoder), after checking its manifest."""
    if not EMBEDDED_ENCODER.verify(Path(path)):
        raise FileNotFoundError(f"{path} is not a complete embedded vision encoder (missing, or its files do not "
                                "match its manifest); run `moonserve prepare` to rebuild it")
    return load_moonvit(path, attention_backend=attention_backend)
