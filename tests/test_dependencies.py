"""Every distribution the installed packages import is declared in pyproject.toml (deptry, configured in
``[tool.deptry]``): an import of a package that only comes with another one (psutil came with prefect) or only with
an extra fails here, so a base install (``pip install -e ".[dev]"``) never meets a ModuleNotFoundError."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPTRY = shutil.which("deptry", path=str(Path(sys.executable).parent)) or shutil.which("deptry")

pytestmark = pytest.mark.skipif(DEPTRY is None, reason="deptry is not installed (pip install -e '.[dev]')")


def deptry(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEPTRY, "."], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_project_declares_every_import():
    done = deptry(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def project_importing(tmp_path: Path, statement: str) -> Path:
    """A copy of the project's declarations with one core module that imports ``statement``."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for package in ("clgrpo", "schemas", "domains", "tasks", "flows"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "clgrpo" / "core.py").write_text(f"def f():\n    {statement}\n")
    return tmp_path


@pytest.mark.parametrize(
    ("statement", "rule"),
    [
        ("import pygments", "DEP003"),  # installed only because rich needs it
        ("import gguf", "DEP004"),  # only in the local extra, and not one of the optional engines
    ],
)
def test_an_undeclared_import_fails_the_check(tmp_path, statement, rule):
    done = deptry(project_importing(tmp_path, statement))
    assert done.returncode != 0
    assert rule in done.stdout + done.stderr
