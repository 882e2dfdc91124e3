"""The installed environment works: the known torchvision/transformers trap is not present, and
the project installs under one import root."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


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


def test_moonserve_is_the_only_import_root(tmp_path):
    """Installed, the project is `moonserve.*`: away from the checkout, none of its folders
    imports bare (`kernels` and `pipeline` are names of other PyPI packages)."""
    code = ("import importlib.util as u, moonserve.pipeline.config, moonserve.deployments.builder, "
            "moonserve.kernels.mxfp4.naive; "
            "print([n for n in ('pipeline', 'deployments', 'kernels') if u.find_spec(n)])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_wheel_holds_only_the_moonserve_root(tmp_path):
    """What a non-editable install puts in site-packages: `moonserve/` and its dist-info."""
    repo = Path(__file__).resolve().parents[2]
    source = tmp_path / "src"  # a copy, so the build leaves no build/ folder in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, source / name)
    for folder in ("pipeline", "deployments", "kernels"):
        shutil.copytree(repo / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("moonserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    assert roots == {"moonserve", f"{wheel.name.split('-py')[0]}.dist-info"}, roots
    assert {"moonserve/pipeline/api/lanes.py", "moonserve/deployments/builder.py",
            "moonserve/kernels/mxfp4/naive.py", "moonserve/pipeline/prepare/store.py"} <= set(names)
