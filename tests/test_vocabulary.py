"""One name for one idea: no public class or function name is defined in two modules of the project.

Two modules defining the same top-level name (``Sample`` for a graded measurement and for one completion,
``decide`` for two different rules) make a reader, an import and a search find the wrong one. The scan covers
the project's packages (not ``tests/`` or ``benchmarks/``): every module's top-level classes and functions whose
names do not start with ``_``. A name several modules define on purpose is in ``ALLOWED``, with why.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "clgrpo", "domains", "tasks", "flows", "application")

# name -> why several modules define it (one line each)
ALLOWED = {
    "main": "each module run as a program has its own entry point (python -m clgrpo.models.embeddings, the sandbox "
    "worker, the clgrpo CLI)",
    "rollout_messages": "each domain's prompt module implements Domain.rollout_messages (math, web)",
    "run_batch": "each local backend's batch function for the engine of clgrpo.llm.local (transformers, vLLM)",
}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def public_definitions() -> dict[str, list[str]]:
    """Each public top-level class or function name -> the modules (paths from the root) that define it."""
    defined: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, kinds) and not node.name.startswith("_"):
                module = path.relative_to(ROOT).as_posix()
                if module not in defined[node.name]:
                    defined[node.name].append(module)
    return defined


def duplicates() -> dict[str, list[str]]:
    return {name: modules for name, modules in sorted(public_definitions().items()) if len(modules) > 1}


def test_no_public_name_is_defined_in_two_modules():
    found = {name: modules for name, modules in duplicates().items() if name not in ALLOWED}
    listed = "\n".join(f"  {name}: {', '.join(modules)}" for name, modules in found.items())
    assert not found, (
        f"public names defined in more than one module (rename the less central one, or merge them when they "
        f"are one idea; a deliberate one goes in ALLOWED with its reason):\n{listed}"
    )


def test_every_allowed_name_is_still_defined_twice():
    """An allowance outlives its reason once the name is defined once: it would only hide a later duplicate."""
    stale = sorted(set(ALLOWED) - set(duplicates()))
    assert not stale, f"ALLOWED names no longer defined in two modules (remove them): {stale}"


def test_the_scan_sees_the_packages():
    defined = public_definitions()
    assert "clgrpo/llm/client.py" in defined["LLMClient"]  # subpackages are scanned
    assert "application/cli.py" in defined["main"]
