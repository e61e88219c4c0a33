"""README's layout section names what the tree holds: every top-level entry and every module of the packages.

A moved or added module fails here until the README says where it went (the layers themselves are checked by
``lint-imports``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schemas", "clgrpo", "clgrpo/app", "clgrpo/llm", "clgrpo/prompts", "clgrpo/testing", "domains", "tasks",
            "flows"]  # fmt: skip
NOT_LISTED = {"README.md", ".gitignore"}  # the file itself, and git's own


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return tracked()


def test_every_top_level_entry_is_named(files):
    block = layout_block()
    tops = {f.split("/")[0] for f in files} - NOT_LISTED
    assert sorted(t for t in tops if t not in block) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named(files, package):
    block = layout_block()
    modules = [Path(f).name for f in files if str(Path(f).parent) == package and f.endswith(".py")]
    assert [m for m in modules if m != "__init__.py" and m not in block] == []


def test_every_folder_the_layout_names_exists():
    for line in layout_block().splitlines():
        head = line.split(" ", 1)[0]
        if head.endswith("/"):
            assert (ROOT / head).is_dir(), head
