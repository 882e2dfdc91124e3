"""The command line and the documented commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def moonserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moonserve.pipeline.app.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_plan_json_sets_the_brief_beside_the_derived_figure():
    out = moonserve("plan", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    b = plan["brief_comparison"]
    assert b["brief_bytes_per_gpu"] == 199e9
    assert b["residual_bytes_per_gpu"] == pytest.approx(plan["used_bytes_per_gpu_at_start"] - 199e9)


def test_plan_rejects_a_layout_vllm_would_refuse():
    out = moonserve("plan", "--decode-context-parallel-size", "3")
    assert out.returncode == 2 and "decode_context_parallel_size" in out.stderr
    assert "Traceback" not in out.stderr


def test_help_lists_the_commands():
    out = moonserve("--help")
    assert out.returncode == 0
    for command in ("prepare", "serve", "bench", "plan"):
        assert command in out.stdout


def readme_commands_in_ci() -> dict[str, list[str]]:
    """`.ci/run`'s `# README: <name>` markers -> the command lines that follow each (up to the
    next comment or blank line)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        if line.startswith("# README: "):
            current = sections.setdefault(line.removeprefix("# README: "), [])
        elif not line.strip() or line.startswith("#"):
            current = None
        elif current is not None:
            current.append(line)
    return sections


def test_ci_runs_exactly_the_readme_setup_and_test_commands():
    readme = (REPO / "README.md").read_text().splitlines()
    sections = readme_commands_in_ci()
    assert sections.get("setup") and sections.get("test"), sections
    for name, commands in sections.items():
        for command in commands:
            assert command in readme, f"{command!r} ({name}) from .ci/run is not a line of README.md"
    # one install command of standard tooling, with no uninstall or second install after it
    installs = [c for c in sections["setup"] if "install" in c]
    assert installs == ["pip install uv", "uv pip install -e '.[cpu,dev]' && moonserve prepare"]
    assert not any("uninstall" in c or "--no-deps" in c for c in readme)


def test_serve_with_a_config_typo_fails_fast_naming_the_key(tmp_path):
    import yaml

    data = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    data["applications"][0]["args"]["language_model"]["engine"]["max_model_lenght"] = 10
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    out = moonserve("serve", "--config", str(path), "--port", "8199")
    assert out.returncode == 2
    assert "language_model.engine.max_model_lenght" in out.stderr.replace("\n  ", ".")
    assert "Traceback" not in out.stderr


def test_serve_with_a_missing_config_fails_fast():
    out = moonserve("serve", "--config", "/nonexistent/moonserve.yaml")
    assert out.returncode == 2 and "/nonexistent/moonserve.yaml" in out.stderr
