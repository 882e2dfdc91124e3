"""Where the embedded build keeps its files, and how a build lands: whole, checked, or not at all.

Every embedded checkpoint is an `Artifact`: a directory `$MOONSERVE_HOME/models/<name>` holding a
manifest of its files' sizes and SHA-256 digests, the artifact's format version and the facts it was
built from (source file, seed, config). A build runs in a sibling staging directory that is moved
into place only when complete (`build_dir`), so an interrupted build never leaves a half-written
directory, and a directory whose manifest does not match is rebuilt rather than trusted.

Example:
    >>> import tempfile
    >>> home = Path(tempfile.mkdtemp())
    >>> notes = Artifact("notes", format_version=1)
    >>> path = notes.ensure(home, lambda d: (d / WEIGHTS_FILE).write_text("w"), seed=3)
    >>> notes.verify(path, seed=3), notes.verify(path, seed=4)
    (True, False)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moonserve.pipeline.models.weights import CONFIG_FILE, WEIGHTS_FILE

MANIFEST = "moonserve-manifest.json"
__all__ = ["CONFIG_FILE", "MANIFEST", "WEIGHTS_FILE", "Artifact", "build_dir", "moonserve_home"]


def moonserve_home() -> Path:
    return Path(os.environ.get("MOONSERVE_HOME", Path.home() / ".cache" / "moonserve"))


@dataclass(frozen=True)
class Artifact:
    """One embedded checkpoint directory under `$MOONSERVE_HOME/models/`."""

    name: str
    # Bumped whenever the build changes, so directories built by older code are rebuilt.
    format_version: int

    def path(self, home: Path | None = None) -> Path:
        return (home or moonserve_home()) / "models" / self.name

    def for_target(self, target: Path | str, default_target: Path) -> Artifact:
        """This artifact when built from `default_target` (the embedded LM); built from another
        target (the tiny test model), a sibling named after that target's folder, so that
        builds for two targets never share, and rebuild, one folder."""
        if Path(target).resolve() == Path(default_target).resolve():
            return self
        return Artifact(f"{self.name}-{Path(target).name}", self.format_version)

    def verify(self, path: Path, **facts) -> bool:
        """True when `path` holds a complete build of this version whose files match its
        manifest, and whose recorded facts equal the `facts` given."""
        return verify_manifest(path, self.format_version, **facts)

    def ensure(self, home: Path | None, write: Callable[[Path], None],
               record: Mapping | None = None, **facts) -> Path:
        """The verified build at `path(home)`, built first when missing or not matching."""
        target = self.path(home)
        if self.verify(target, **facts):
            return target
        return self.build(home, write, record, **facts)

    def build(self, home: Path | None, write: Callable[[Path], None],
              record: Mapping | None = None, **facts) -> Path:
        """Run `write(staging)`, add the manifest, move the directory into place; its path.

        `facts` are recorded and must match on reuse; `record` is only recorded (what a build
        came from, when reuse must not depend on it still being there).
        """
        def write_with_manifest(staging: Path) -> None:
            write(staging)
            write_manifest(staging, self.format_version, **(record or {}), **facts)

        return build_dir(self.path(home), write_with_manifest)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(out_dir: Path, format_version: int, **facts) -> None:
    """The manifest of every file in `out_dir`, written last: a build without it is redone."""
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {
        **_as_json(facts),
        "format_version": format_version,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def verify_manifest(path: Path, format_version: int, **facts) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format_version") != format_version:
        return False
    if any(manifest.get(key) != value for key, value in _as_json(facts).items()):
        return False
    files = manifest.get("files", {})
    return WEIGHTS_FILE in files and all(
        (path / name).is_file() and (path / name).stat().st_size == entry["bytes"]
        and file_digest(path / name) == entry["sha256"]
        for name, entry in files.items())


def _as_json(facts: dict) -> dict:
    """Facts as they read back from the manifest (tuples become lists)."""
    return json.loads(json.dumps(facts, sort_keys=True))


def build_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging)` in a sibling directory, then move it to `out_dir`; returns `out_dir`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write(staging)
        # mkdtemp makes the directory 0700 and safetensors its files 0600; checkpoints are shared
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def replace_dir(staging: Path, target: Path) -> None:
    """Move a finished build into place; an old or broken `target` is moved aside first."""
    if target.exists():
        graveyard = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, graveyard / target.name)
        shutil.rmtree(graveyard, ignore_errors=True)
    os.replace(staging, target)
