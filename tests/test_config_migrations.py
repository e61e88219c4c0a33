"""What names a run's results, over many configs: each of a few base configs (the defaults, the gate off, the
checks on, agent rollouts, retrieval, hybrid learning, every optional section set, the web domain) and every
config one setting away from it, with the run fingerprint, the evaluation fingerprint and the sample key's
identity of each. ``tests/snapshots/config_fingerprints.json`` holds them, hashed per base and section (a
refactor must leave them byte-identical; ``CLGRPO_UPDATE_SNAPSHOTS=1`` rewrites them, for a change meant to
alter them, and the commit says which)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import domains  # noqa: F401 - the registry reads the web domain's settings
from flows.evaluate import eval_fingerprint
from schemas.config import DatasetConfig, EvalConfig, RunConfig
from schemas.records import Problem, text_hash
from tasks.measure import Sampling

SNAPSHOT = Path(__file__).parent / "snapshots" / "config_fingerprints.json"
UPDATE = os.environ.get("CLGRPO_UPDATE_SNAPSHOTS") == "1"

BASES: dict[str, dict[str, Any]] = {
    "default": {},
    "gate-off": {"learning": {"library_gate": {"enabled": False}}},
    "checks": {"learning": {"lesson_validation": {"enabled": True}, "library_gate": {"enabled": False}}},
    "agent": {"rollout": {"mode": "agent"}},
    "library": {"library": {"injection": "top_k", "near_duplicates": "reject"}},
    "hybrid": {"hybrid": {"enabled": True}},
    "sections": {"validation": {"dataset": {"path": "v.jsonl"}}, "judge": {}, "learner": {"model": "l"}},
    "web": {"domain": "web", "rollout": {"mode": "agent"}, "domain_settings": {"search": {"top_k": 3}}},
}
WEB_SETTINGS: list[dict[str, Any]] = [
    {},
    {"search": {"top_k": 5}},
    {"open": {"max_links": 9}},
    {"search": {"backend": "http", "url_template": "http://x/{query}"}},
]
# the values a setting is tried with (those its section accepts, at most three per setting)
WORDS = (
    "auto off reject merge top_k all turns block llm passthrough contrast operations compare agreement strict "
    "standard rollouts rationalize sign mean others sources_first plan support better significant agent direct "
    "pool local tools text skip error transformers vllm openai embedded float32 bfloat16 x"
).split()
PROBLEMS = [Problem(problem_id="p1", problem="What is 2 + 3?", answer="5")]
EVALUATION = EvalConfig(dataset=DatasetConfig(path="e.jsonl"))


def tried_values(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, 1, 0]
    if isinstance(value, float):
        return [round(value + 0.05, 6), value * 0.5, value + 1]
    if isinstance(value, str):
        return [*WORDS, value + "x"]
    if value is None:
        return [1, 2, 0.5, "x", "auto", ["x"], True, "bfloat16", {"a": 1}]
    if isinstance(value, list):
        return [["x"], [{"text": "Do not guess the answer ever.", "reason": "r"}]]
    if isinstance(value, dict) and not value:
        return [{"a": 1}]
    return []


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        for key in sorted(tree):
            yield from leaves(tree[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def with_value(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    *parents, last = path.split(".")
    holder = tree
    for part in parents:
        holder = holder[part]
    holder[last] = value
    return tree


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) and value else value
    return out


def names(config: RunConfig) -> list[str]:
    """What names the results of ``config``: its run fingerprint, an evaluation's and a sample key's identity."""
    evaluation = eval_fingerprint(config, EVALUATION, [], PROBLEMS)
    return [config.fingerprint(), evaluation, Sampling.of(config, 0.5).identity]


def corpus() -> dict[str, list[str]]:
    """``base``, ``base:setting=value`` (one setting changed) and ``base:web-settings=...`` -> names."""
    out: dict[str, list[str]] = {}
    for base_name, extra in BASES.items():
        given = merged({"run_id": "r", "dataset": {"path": "t.jsonl"}}, extra)
        base = RunConfig.model_validate(given)
        out[base_name] = names(base)
        dump = base.model_dump(mode="json") | {"domain_settings": given.get("domain_settings", {})}
        for path, value in leaves({k: v for k, v in dump.items() if k not in ("domain", "domain_settings")}):
            tried = 0
            for other in tried_values(value):
                if other == value or tried == 3:
                    continue
                try:
                    config = RunConfig.model_validate(with_value(dump, path, other))
                except (ValidationError, ValueError):
                    continue
                tried += 1
                out[f"{base_name}:{path}={json.dumps(other)}"] = names(config)
        if base_name in ("default", "agent", "web"):
            for settings in WEB_SETTINGS:
                config = RunConfig.model_validate(dump | {"domain": "web", "domain_settings": settings})
                out[f"{base_name}:web-settings={json.dumps(settings, sort_keys=True)}"] = names(config)
    return out


def grouped(cases: dict[str, list[str]]) -> dict[str, str]:
    """The cases hashed per base and section (``agent:learning``), so that a change names where it is."""
    groups: dict[str, dict[str, list[str]]] = {}
    for case, value in cases.items():
        base, _, setting = case.partition(":")
        group = setting.split("=")[0].split(".")[0] if setting else ""
        groups.setdefault(f"{base}:{group}" if group else base, {})[case] = value
    return {group: text_hash(json.dumps(members, sort_keys=True)) for group, members in groups.items()}


def test_what_names_results_is_unchanged_over_a_corpus_of_configs():
    text = json.dumps(grouped(corpus()), indent=1, sort_keys=True) + "\n"
    if UPDATE:
        SNAPSHOT.write_text(text, encoding="utf-8")
    expected, now = json.loads(SNAPSHOT.read_text(encoding="utf-8")), json.loads(text)
    changed = sorted(group for group in expected.keys() | now.keys() if expected.get(group) != now.get(group))
    assert not changed, f"{SNAPSHOT.name}: what names results changed in {changed}"
