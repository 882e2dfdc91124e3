"""Chat templates shipped with moonserve (`language_model.chat.template` by name), or any file.

Example:
    >>> chat_template_text("smollm2_tools")[:20]     # the embedded model's template with tools
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def chat_template_path(name_or_path: str) -> Path:
    """A shipped template's file by name, else `name_or_path` as a path (it must exist)."""
    shipped = TEMPLATES_DIR / f"{name_or_path}.jinja"
    if shipped.is_file():
        return shipped
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template {name_or_path!r} is neither a shipped template "
                                f"({', '.join(shipped_templates())}) nor a file")
    return path


def chat_template_text(name_or_path: str) -> str:
    return chat_template_path(name_or_path).read_text()
