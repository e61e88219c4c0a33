"""The core's layout reads as its architecture: a few rooms by concern (clgrpo/'s sub-packages), each saying what
it is in one line, each placed in the import contract that holds their directions, and no module too long to read.

CONTRIBUTING.md ("The core's rooms") says which room a module goes to.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "clgrpo"
PACKAGES = ("application", "clgrpo", "schemas", "domains", "tasks", "flows")
MAX_TOP_ENTRIES = 12  # modules and sub-packages at the top of clgrpo/, __init__.py not counted
MAX_LINES = 800  # a source file of the packages
# sub-packages from before the rooms, whose __init__ does more than name the room: llm re-exports its client,
# prompts and testing list their modules in their docstrings
OLDER_PACKAGES = {"llm", "prompts", "testing"}


def top_entries() -> list[str]:
    return sorted(
        p.stem if p.is_file() else p.name
        for p in CORE.iterdir()
        if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").is_file())
    )


def rooms() -> list[Path]:
    return sorted(p for p in CORE.iterdir() if (p / "__init__.py").is_file())


def core_layers() -> list[str]:
    """The rooms named by the layers contract within clgrpo (pyproject.toml), top to bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["clgrpo"]]
    return [name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")]


def test_the_core_has_a_few_rooms_at_its_top():
    entries = top_entries()
    assert len(entries) <= MAX_TOP_ENTRIES, f"clgrpo/ holds {len(entries)} entries at its top: {entries}"
    assert [e for e in entries if (CORE / f"{e}.py").is_file()] == [], "a core module belongs in a room"


def test_each_room_says_what_it_is_in_one_line_and_nothing_else():
    for room in rooms():
        if room.name in OLDER_PACKAGES:
            continue
        init = room / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree, clean=False)
        assert doc and "\n" not in doc, f"{init.relative_to(ROOT)}: no one-line docstring"
        assert len(tree.body) == 1, f"{init.relative_to(ROOT)}: more than its docstring (import from the modules)"


def test_every_room_is_placed_in_the_import_contract():
    layers = core_layers()
    assert sorted(layers) == sorted(room.name for room in rooms()), "pyproject.toml: the core's layers contract"


def test_no_source_file_is_too_long_to_read():
    long = {
        path.relative_to(ROOT).as_posix(): n
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"over {MAX_LINES} lines: split each along a seam (CONTRIBUTING.md)"
