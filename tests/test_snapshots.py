"""Snapshots of what reaches a model and what names a result: every prompt family rendered on fixed inputs, and
the fingerprints of the shipped configs and the demo's. A refactor must leave them byte-identical; a deliberate
change rewrites them with ``CLGRPO_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshots.py`` and shows in the
diff of tests/snapshots/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from application.demo import DemoOptions, demo_config
from clgrpo.inputs.config import load_config
from clgrpo.prompts.attempts import Attempt
from clgrpo.prompts.consolidate import consolidate_messages
from clgrpo.prompts.contrast import contrast_example, contrast_messages, generalize_messages
from clgrpo.prompts.extract import extract_messages
from clgrpo.prompts.judge import judge_messages
from clgrpo.prompts.lessons import example_reply
from clgrpo.prompts.rationalize import rationalize_messages
from clgrpo.prompts.repair import repair_messages
from clgrpo.prompts.rollout import ShownExample
from clgrpo.prompts.shorten import shorten_messages
from clgrpo.prompts.specificity import rater_messages
from clgrpo.prompts.summarize import summarize_messages
from domains import get_domain
from schemas.records import Problem
from tasks.rationalize import SOLUTION_WORDS

SNAPSHOTS = Path(__file__).parent / "snapshots"
ROOT = Path(__file__).resolve().parents[1]
UPDATE = os.environ.get("CLGRPO_UPDATE_SNAPSHOTS") == "1"

PROBLEM = Problem(
    problem_id="p7", problem="A shirt costs 40 dollars and its price falls by 25%. What is the new price?", answer="30"
)
LIBRARY = "[E1]. When a price falls by a percent, multiply by one minus that percent.\n[E2]. Check the units first."
RIGHT = Attempt(0, "40 * 0.75 = 30. The answer is \\boxed{30}.", 1.0)
WRONG = Attempt(1, "40 * 0.25 = 10. The answer is \\boxed{10}.", 0.0, truncated=True, tools="python: print(40*0.25)")
SUMMARIZED = Attempt(2, "40 - 25 = 15.", 0.0, summary="Subtracted the percent as if it were dollars.")


def _prompts() -> dict[str, object]:
    """Every prompt family, each rendered in its variants (with and without grades, library, example)."""
    out: dict[str, object] = {}
    for name in ("math", "web"):
        domain = get_domain(name)
        prompts = domain.learner_prompts
        out[f"{name}/rollout"] = domain.rollout_messages(PROBLEM, LIBRARY)
        out[f"{name}/rollout-empty"] = domain.rollout_messages(PROBLEM, "")
        solved = [
            ShownExample("A shirt costs 40 dollars; it is 10% off. What does it cost?", "40 - 4 = 36. \\boxed{36}")
        ]
        for form in ("turns", "block"):
            out[f"{name}/rollout-example-{form}"] = domain.rollout_messages(PROBLEM, LIBRARY, solved, form)
        out[f"{name}/rationalize"] = rationalize_messages(domain.rollout_messages(PROBLEM, ""), "30", SOLUTION_WORDS)
        for truth in (True, False):
            ask = prompts.ask(use_groundtruth=truth, max_ops=3, min_words=6, max_words=40)
            out[f"{name}/summarize-{truth}"] = summarize_messages(ask, PROBLEM, WRONG, LIBRARY)
            for library in (LIBRARY, ""):
                for show in (True, False):
                    key = f"{truth}-{bool(library)}-{show}"
                    attempts = [RIGHT, WRONG, SUMMARIZED]
                    out[f"{name}/extract-{key}"] = extract_messages(ask, PROBLEM, attempts, library, show_example=show)
                    out[f"{name}/contrast-{key}"] = contrast_messages(
                        ask, PROBLEM, RIGHT, WRONG, library, live_ids=["E1", "E2"] if library else [],
                        show_example=show,
                    )  # fmt: skip
        ask = prompts.ask(min_words=6, max_words=40)
        asked = out[f"{name}/contrast-True-True-False"]
        out[f"{name}/generalize"] = generalize_messages(
            ask, asked, "Multiply 40 by 0.75.", "it names the problem's numbers"
        )
        for show in (True, False):
            out[f"{name}/consolidate-{show}"] = consolidate_messages(ask, '{"p7": []}', LIBRARY, show_example=show)
            for sources in (True, False):
                out[f"{name}/repair-{show}-{sources}"] = repair_messages(
                    ask, asked, "not json", "no JSON object", show_example=show, sources=sources
                )
        out[f"{name}/contrast-example"] = contrast_example(prompts.examples, True)
        out[f"{name}/example-reply"] = example_reply(prompts.examples, sources=True)
    out["judge"] = judge_messages(PROBLEM, "The new price is 30 dollars.")
    out["specificity"] = rater_messages("mathematics", "Always check your work.")
    out["shorten"] = shorten_messages("mathematics", "When a price falls by a percent, multiply ...", 45, 6, 40)
    return out


def _fingerprints() -> dict[str, str]:
    out = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if not path.name.startswith("refresh"):
            out[path.name] = load_config(path).fingerprint()
    opts = DemoOptions(out=Path("runs/demo"))
    for engine in ("transformers", "llama-server"):
        config = demo_config(opts, {"train": "train.jsonl", "test": "test.jsonl"}, "demo", engine=engine)
        out[f"demo-{engine}"] = config.fingerprint()
    return out


@pytest.mark.parametrize(("name", "build"), [("prompts", _prompts), ("fingerprints", _fingerprints)])
def test_snapshots_are_byte_identical(name, build):
    text = json.dumps(build(), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    path = SNAPSHOTS / f"{name}.json"
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert path.read_text(encoding="utf-8") == text, f"{path} changed: rewrite it only for a deliberate change"
