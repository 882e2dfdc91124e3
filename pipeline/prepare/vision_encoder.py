"""The embedded vision encoder: a small, seeded, random MoonViT-V2 for machines without the real one.

Same architecture and checkpoint names as the production encoder (14x14 patches, 64x64 position
table, 2D rotary, 2x2 merge, patchmergerv2 projector), narrower and shallower: hidden 96, 2 heads of
64, 2 layers, projecting to the embedded LM's hidden size (576, SmolLM2-135M). Its weights are random,
so its embeddings carry no meaning; it exists so that the image path runs end to end on a CPU and
so that the production loader (moonserve.pipeline.models.moonvit.load_moonvit) is what loads it.

Written under ``$MOONSERVE_HOME/models/moonvit-embedded/`` as ``model.safetensors`` + ``config.json``
+ a SHA-256 manifest, built in a temporary directory and renamed into place; a directory whose
manifest matches (files, seed, config) is reused.

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
import shutil
import tempfile
from pathlib import Path

import torch

from moonserve.pipeline.prepare.language_model import MANIFEST, file_digest, moonserve_home, replace_dir
from moonserve.pipeline.models.moonvit import MoonViT, MoonViTConfig, expected_tensor_shapes, load_moonvit

EMBEDDED_ENCODER_NAME = "moonvit-embedded"
WEIGHTS_FILE = "model.safetensors"
# Bumped whenever the architecture or the initialization changes, so older builds are rebuilt.
FORMAT_VERSION = 1


def embedded_encoder_config(text_hidden_size: int = 576) -> MoonViTConfig:
    """The production config, narrowed: hidden 96, 2 heads x 64 (qkv 128), MLP 384, 2 layers.

    qkv_hidden_size != vt_hidden_size as in production (1536 vs 1024), so wo is not square.
    """
    return MoonViTConfig(vt_hidden_size=96, vt_num_attention_heads=2, qkv_hidden_size=128,
                         vt_intermediate_size=384, vt_num_hidden_layers=2, text_hidden_size=text_hidden_size)


def embedded_encoder_dir(home: Path | None = None) -> Path:
    return (home or moonserve_home()) / "models" / EMBEDDED_ENCODER_NAME


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


def write_manifest(out_dir: Path, cfg: MoonViTConfig, seed: int) -> None:
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "config": cfg.to_dict(),
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def verify_encoder_dir(path: Path, cfg: MoonViTConfig | None = None, seed: int | None = None) -> bool:
    """True when path holds a complete build matching its manifest (and cfg / seed, if given)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format_version") != FORMAT_VERSION or seed is not None and manifest.get("seed") != seed:
        return False
    if cfg is not None and MoonViTConfig.from_dict(manifest.get("config", {})) != cfg:
        return False
    files = manifest.get("files", {})
    return WEIGHTS_FILE in files and all(
        (path / name).is_file() and (path / name).stat().st_size == entry["bytes"]
        and file_digest(path / name) == entry["sha256"]
        for name, entry in files.items())


def build_encoder_dir(out_dir: Path, cfg: MoonViTConfig, seed: int) -> None:
    from safetensors.torch import save_file

    save_file(random_state_dict(cfg, seed), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    for file in out_dir.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; the checkpoint is meant to be shared
    write_manifest(out_dir, cfg, seed)


def write_embedded_encoder(home: Path, text_hidden_size: int = 576, seed: int = 0) -> Path:
    """Build (or verify and reuse) the embedded encoder under home/models/moonvit-embedded; its path.

    About 4 MB (1.6 MB of it the 64x64 position table), under a second to build. An interrupted
    build never leaves a half-written directory in place; a corrupted one, or one of another seed or
    config, is rebuilt.
    """
    target, cfg = embedded_encoder_dir(home), embedded_encoder_config(text_hidden_size)
    if verify_encoder_dir(target, cfg, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_ENCODER_NAME}-", dir=target.parent))
    try:
        build_encoder_dir(staging, cfg, seed)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the checkpoint is meant to be shared
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_embedded_encoder(path: Path, attention_backend: str = "auto") -> MoonViT:
    """The float32 MoonViT at path (as written by write_embedded_encoder), after checking its manifest."""
    if not verify_encoder_dir(Path(path)):
        raise FileNotFoundError(f"{path} is not a complete embedded vision encoder (missing, or its files do not "
                                "match its manifest); run `moonserve prepare` to rebuild it")
    return load_moonvit(path, attention_backend=attention_backend)
