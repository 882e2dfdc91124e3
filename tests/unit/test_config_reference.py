"""docs/configuration.md's field reference is generated from the typed config and agrees with it."""

from __future__ import annotations

import difflib

import pytest

from moonserve.pipeline.app.cli import main
from moonserve.pipeline.config_reference import (
    BEGIN,
    COMMAND,
    END,
    PAGE,
    generated_part,
    holders,
    model_fields,
    render,
)


def test_docs_field_reference_is_what_the_config_renders():
    written, expected = generated_part(PAGE.read_text()), render()
    if written != expected:
        diff = difflib.unified_diff(written.splitlines(), expected.splitlines(),
                                    "docs/configuration.md", "render()", lineterm="", n=1)
        pytest.fail(f"docs/configuration.md's field reference differs from pipeline/config.py: "
                    f"run `{COMMAND}`\n" + "\n".join(list(diff)[:40]))


def test_every_field_has_a_description():
    missing = [f"{cls.__name__}.{name}" for cls in holders()
               for name, field in model_fields(cls).items() if not field.description]
    assert not missing, f"give these fields a Field(description=...): {missing}"


def test_the_reference_covers_every_leaf_key_with_its_default_there():
    text = render()
    for row in ("| `router.limits.max_request_bytes` | int > 0 | `1048576` |",
                "| `router.deployment` | [DeploymentOptions](#deploymentoptions) | "
                "`{max_ongoing_requests: 256}` |",
                "| `draft.mode` | `service` \\| `inline` \\| `off` | `off` |",
                "| `router.lanes.*.max_in_flight` | int > 0 | required |"):
        assert row in text
    assert "```" not in text  # tests/unit/test_config.py reads every yaml block as config args


def test_write_replaces_only_the_generated_part(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Kept\n\n{BEGIN}\nstale\n{END}\n\nKept too.\n")
    assert main(["config-reference", "--write", str(page)]) == 0
    assert page.read_text().startswith("# Kept\n\n") and page.read_text().endswith("Kept too.\n")
    assert generated_part(page.read_text()) == render()


def test_write_refuses_a_page_without_the_markers(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# No markers\n")
    assert main(["config-reference", "--write", str(page)]) == 2
    assert "config-reference" in capsys.readouterr().err
    assert page.read_text() == "# No markers\n"
