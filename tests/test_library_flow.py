"""The library's budget, retrieval and domains in real runs: the scripted policy/learner over HTTP, embeddings
over HTTP from a loopback /v1/embeddings server, a real Prefect harness and DuckDB file. Every rollout prompt
the server receives is checked for which lessons it showed."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from application.cli import main
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.reports.report import write_report
from clgrpo.storage.store import Store
from clgrpo.testing.fake_embeddings import EmbeddingServer
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, role_of
from clgrpo.testing.scripted_llm import (
    FAMILIES,
    FAMILY_BY_NAME,
    ScriptedWorld,
    find_problem,
    make_problems,
    write_jsonl,
)
from flows.train import train
from schemas.config import (
    DatasetConfig,
    EmbeddingConfig,
    GRPOConfig,
    LearningConfig,
    LibraryConfig,
    ModelConfig,
    RunConfig,
)
from schemas.records import OpKind
from tests.gates import UNGATED

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]
LINE = re.compile(r"^\[(E\d+)\]\.\s*(.*)$", re.MULTILINE)
DISTRACTORS = [
    "Read the question twice and underline what is asked before writing anything.",
    "Write each intermediate result on its own line so a slip is easy to find.",
    "Estimate the size of the answer first and compare the final result with it.",
    "State the final answer once, in the requested form, at the very end.",
]


class Recorder:
    """The scripted world, remembering each policy prompt's problem family and the lessons it listed."""

    def __init__(self, world: ScriptedWorld) -> None:
        self.world, self.lock, self.prompts = world, threading.Lock(), []
        self.models = world.models

    def __call__(self, request: ChatRequest) -> list[str]:
        if role_of(request) == "policy":
            text = "\n".join(str(m.get("content") or "") for m in request.messages)
            found = find_problem(text)
            with self.lock:
                self.prompts.append((found[0].name if found else None, dict(LINE.findall(text))))
        return self.world(request)


def family_vector(text: str) -> list[float]:
    """One axis per problem family (its name and its lesson's verb), one for everything else."""
    words = text.casefold()
    axes = [("sums", "adding"), ("products", "multiplying"), ("differences", "subtracting"), ("remainder",)]
    vector = [float(any(w in words for w in axis)) for axis in axes] + [0.2]
    norm = sum(v * v for v in vector) ** 0.5
    return [v / norm for v in vector]


def config(
    tmp_path: Path,
    server: FakeOpenAIServer,
    run_id: str,
    *,
    library: LibraryConfig,
    dataset: Path,
    epochs: int = 2,
    domain_field: str | None = None,
    **extra,
) -> RunConfig:
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        policy=model,
        concurrency=8,
        dataset=DatasetConfig(path=str(dataset), seed=1, domain_field=domain_field),
        grpo=GRPOConfig(group_size=4, epochs=epochs, batch_size=12, rollout_chunk_size=4),
        learning=LearningConfig(consolidate_chunk_size=3, summarize_chunk_size=4, library_gate=UNGATED),
        library=library,
        **extra,
    )


async def test_a_budgeted_run_never_exceeds_its_budget_and_lists_its_evictions(tmp_path, capsys):
    dataset = write_jsonl(make_problems(n_per_family=3, seed=3), tmp_path / "train.jsonl")
    budget = 45  # two of the four family lessons fit
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        cfg = config(tmp_path, server, "budget", library=LibraryConfig(max_tokens=budget), dataset=dataset)
        result = await train(cfg)

    with Store(cfg.db_path, read_only=True) as store:
        versions = [store.load_library(cfg.run_id, v) for v in store.library_versions(cfg.run_id)]
        results = store.operation_results(cfg.run_id)
        quality = store.records("library_quality", cfg.run_id)
    assert all(v.prompt_tokens() <= budget for v in versions)
    evictions = [r for _, r in results if r.operation.op == OpKind.EVICT]
    assert evictions and all(r.status.value == "applied" for r in evictions)
    assert all(
        r.reason.startswith("over the token budget: library ")
        and f"library.max_tokens={budget}" in r.reason
        and "lowest usefulness: confidence" in r.reason
        for r in evictions
    )
    created = [r.result_id for _, r in results if r.operation.op == OpKind.ADD and r.status.value == "applied"]
    assert len(created) == len(set(created))  # ids are never reused
    assert {r.result_id for r in evictions} <= versions[-1].retired_ids
    assert [q.version for q in quality] == [s.step for s in result.steps]
    assert all(q.tokens <= budget for q in quality) and sum(q.evicted for q in quality) == len(evictions)
    assert any(q.coverage is not None for q in quality) and sum(q.added for q in quality) >= 3

    assert main(["library", "show", cfg.run_id, "--db", cfg.db_path]) == 0
    shown = capsys.readouterr().out
    assert "tokens (estimated)" in shown and "never cited" in shown and "churn +" in shown
    assert re.search(r"cited \d+x \([\d.]+ correct / [\d.]+ wrong", shown)
    assert main(["library", "ops", cfg.run_id, "--db", cfg.db_path]) == 0
    assert "applied  evict" in capsys.readouterr().out
    with Store(cfg.db_path, read_only=True) as store:
        report = write_report(store, cfg.run_id, tmp_path / "report", fmt="md").read_text()
    assert "## Library quality per step" in report and "evicted" in report
    async with get_client() as client:  # the step artifact, as the Prefect UI shows it
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["budget-quality"]))
        )
    rows = json.loads(max(artifacts, key=lambda a: a.created).data)  # the latest version of the artifact
    assert [r["version"] for r in rows] == [q.version for q in quality] and rows[-1]["tokens"] <= budget


async def test_top_k_shows_each_problem_its_nearest_lessons_and_the_pinned_one(tmp_path):
    start = tmp_path / "start.txt"
    lessons = [f.lesson for f in FAMILIES] + DISTRACTORS
    start.write_text("".join(f"[E{i}]. {t}\n" for i, t in enumerate(lessons)))
    dataset = write_jsonl(make_problems(n_per_family=3, seed=3), tmp_path / "train.jsonl")
    embeddings = EmbeddingServer(vector=family_vector)
    try:
        recorder = Recorder(ScriptedWorld(seed=7))
        with FakeOpenAIServer(recorder) as server:
            settings = LibraryConfig(
                injection="top_k",
                top_k=1,
                pinned=["E7"],
                embedding=EmbeddingConfig(
                    backend="openai", model="families", base_url=embeddings.base_url, api_key_env=None
                ),
            )
            cfg = config(
                tmp_path, server, "top-k", library=settings, dataset=dataset, epochs=1, initial_library=str(start)
            )
            await train(cfg)
    finally:
        embeddings.close()

    assert len(recorder.prompts) == 12  # one request of n=4 samples per problem
    for family, listed in recorder.prompts:
        assert set(listed) == {f"E{[f.name for f in FAMILIES].index(family)}", "E7"}, (family, listed)
    all_prompt = len(ExperienceLibrary.load(start).render_for_prompt())
    assert all(sum(len(t) for t in listed.values()) < all_prompt / 3 for _, listed in recorder.prompts)


async def test_a_mixed_dataset_routes_each_domain_to_its_own_lessons(tmp_path):
    rows = [{**p, "family": p["id"].split("-")[0]} for p in make_problems(n_per_family=3, seed=3)]
    dataset = write_jsonl(rows, tmp_path / "mixed.jsonl")
    recorder = Recorder(ScriptedWorld(seed=7))
    with FakeOpenAIServer(recorder) as server:
        cfg = config(tmp_path, server, "domains", library=LibraryConfig(), dataset=dataset, domain_field="family")
        await train(cfg)

    with Store(cfg.db_path, read_only=True) as store:
        library = store.load_library(cfg.run_id)
        problems = store.records("problems", cfg.run_id)
    assert {p.domain_tag for p in problems} == {f.name for f in FAMILIES}
    tags = {e.text: e.domain_tag for e in library}
    learned = {f.name: tags[f.lesson] for f in FAMILIES if f.lesson in tags}
    assert len(learned) >= 3 and all(tag == name for name, tag in learned.items())
    by_id = {e.id: e for e in library}
    second_step = [(family, listed) for family, listed in recorder.prompts if listed]
    assert second_step, "no rollout prompt listed a lesson"
    for family, listed in second_step:
        assert all(by_id[i].domain_tag in (family, None) for i in listed if i in by_id), (family, listed)
        assert all(FAMILY_BY_NAME[family].key in text for text in listed.values()), (family, listed)
