"""Every prompt text lives in ``clgrpo/prompts`` (one module per role), and that package stays in the core layer.

A simple guard rather than a scan for prompt-like strings: outside the package no code writes a system message
or a ``ROLE:`` line (what every learner and judge prompt starts with), and the package imports only the
standard library, ``schemas`` and itself, so every layer may use it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "clgrpo" / "prompts"
PACKAGES = ("clgrpo", "domains", "tasks", "flows", "schemas")
ALLOWED_OUTSIDE = {ROOT / "clgrpo" / "testing"}  # fake servers read the ROLE line of the requests they answer


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _outside_prompts() -> list[Path]:
    files = [p for package in PACKAGES for p in _modules(ROOT / package)]
    return [p for p in files if PROMPTS not in p.parents and not any(a in p.parents for a in ALLOWED_OUTSIDE)]


def _system_messages_and_role_lines(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                is_role = isinstance(key, ast.Constant) and key.value == "role"
                if is_role and isinstance(value, ast.Constant) and value.value == "system":
                    lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ROLE:"):
            lines.append(node.lineno)
    return lines


def test_no_prompt_is_written_outside_the_prompts_package():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in _outside_prompts()
        if (lines := _system_messages_and_role_lines(ast.parse(path.read_text(), str(path))))
    }
    assert not found, f"system messages or ROLE lines outside clgrpo/prompts (move them there): {found}"


def test_every_role_module_says_what_it_is_for():
    for path in _modules(PROMPTS):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no module docstring"


@pytest.mark.parametrize("path", _modules(PROMPTS), ids=lambda p: p.name)
def test_the_prompts_package_imports_only_the_standard_library_and_schemas(path):
    tree = ast.parse(path.read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
    allowed = ("schemas", "clgrpo.prompts", "__future__")
    wrong = [
        m
        for m in imported
        if m.split(".")[0] not in sys.stdlib_module_names and not any(m == a or m.startswith(a + ".") for a in allowed)
    ]
    assert not wrong, f"{path.name} imports {wrong}: clgrpo.prompts is core (stdlib and schemas only)"
