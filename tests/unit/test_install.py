"""The installed environment works: the known torchvision/transformers trap is not present."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def test_engine_serve_and_model_classes_import():
    code = ("import vllm, ray.serve; from transformers import LlamaConfig, LlamaForCausalLM; "
            "print(vllm.__version__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_broken_torchvision_is_not_installed():
    """PyPI's torchvision/torchaudio/torchcodec fail beside torch 2.13.0+cpu and break
    transformers' model imports; setup removes them, so each is absent or imports cleanly."""
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"{name} is installed but fails to import: {result.stderr[-500:]}"


def test_embedded_gguf_is_installed():
    from moonserve.pipeline.prepare.language_model import locate_gguf

    assert locate_gguf().stat().st_size > 50_000_000
