"""`moonserve prepare`: the converted checkpoint is complete, verified on reuse, built atomically."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from moonserve.pipeline.prepare import language_model as embedded
from moonserve.pipeline.prepare.language_model import EMBEDDED_LM, prepare_language_model
from moonserve.pipeline.prepare.store import MANIFEST

verify_checkpoint = EMBEDDED_LM.verify


@pytest.fixture(scope="module")
def checkpoint():
    return prepare_language_model(progress=False)


def test_checkpoint_is_a_float32_llama_with_tied_embeddings_and_chat_template(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32" and "quantization_config" not in config
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 272
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_prepare_reuses_a_verified_checkpoint(checkpoint):
    before = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert prepare_language_model(progress=False) == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == before


def test_cli_prepare_prints_the_paths(checkpoint):
    from moonserve.pipeline.prepare.drafter import EMBEDDED_DRAFTER
    from moonserve.pipeline.prepare.vision_encoder import EMBEDDED_ENCODER
    from moonserve.pipeline.prepare.wheels import BFCL_EVAL

    out = subprocess.run([sys.executable, "-m", "moonserve.pipeline.app.cli", "prepare", "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    encoder, drafter = EMBEDDED_ENCODER.path(), EMBEDDED_DRAFTER.path()
    assert out.stdout.split() == [str(checkpoint), str(encoder), str(drafter), str(BFCL_EVAL.path())]
    assert EMBEDDED_ENCODER.verify(encoder) and EMBEDDED_DRAFTER.verify(drafter)


def copy_checkpoint(checkpoint, tmp_path):
    copy = tmp_path / "models" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_verify_rejects_damaged_checkpoints(checkpoint, tmp_path, damage):
    copy = copy_checkpoint(checkpoint, tmp_path)
    assert verify_checkpoint(copy)
    target = copy / "tokenizer.json"
    if damage == "truncate":
        os.truncate(target, target.stat().st_size - 1)
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[100] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        (copy / MANIFEST).write_text("{")
    assert not verify_checkpoint(copy)


def test_interrupted_build_leaves_nothing_trusted(tmp_path, monkeypatch):
    def build_then_crash(gguf_path, out_dir, progress=True):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "build_checkpoint", build_then_crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_language_model(home=tmp_path, progress=False)
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # no staging dir left, no target created


def test_damaged_checkpoint_is_rebuilt(checkpoint, tmp_path, monkeypatch):
    copy = copy_checkpoint(checkpoint, tmp_path)
    (copy / "config.json").write_text("{}")
    built = []

    def fake_build(gguf_path, out_dir, progress=True):
        for f in checkpoint.iterdir():
            shutil.copy(f, out_dir / f.name)
        built.append(out_dir)

    monkeypatch.setattr(embedded, "build_checkpoint", fake_build)
    assert prepare_language_model(home=tmp_path, progress=False) == copy
    assert built and verify_checkpoint(copy)
    assert sorted(p.name for p in copy.parent.iterdir()) == [copy.name]
