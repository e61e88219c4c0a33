"""Near-duplicate control (library.near_duplicates): an add or modify close to a live experience in embedding
space is rejected with the id and the similarity, or merged into it; embeddings are computed once per text and
model and kept in DuckDB. The flow test embeds over real HTTP (a loopback /v1/embeddings server with
bag-of-words vectors, so texts sharing words are similar)."""

from __future__ import annotations

import pytest

from clgrpo.experience.library import ExperienceLibrary, NearDuplicates, normalize_text
from clgrpo.storage.store import Store
from clgrpo.testing.fake_embeddings import EmbeddingServer, bag_of_words
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import FAMILIES, ScriptedWorld, make_problems, write_jsonl
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
from schemas.records import Operation

CARRY = "When adding numbers, carry the tens digit."
CARRY_AGAIN = "When you add, carry the tens."
REMAINDER = "When dividing, check the remainder first."
VECTORS = {
    normalize_text(CARRY): [1.0, 0.0],
    normalize_text(CARRY_AGAIN): [0.96, 0.28],
    normalize_text(REMAINDER): [0.0, 1.0],
}


def library() -> ExperienceLibrary:
    return ExperienceLibrary.from_mapping({"E0": CARRY})


def test_a_near_duplicate_add_is_rejected_with_the_id_and_the_similarity():
    ops = [Operation(op="add", text=CARRY_AGAIN), Operation(op="add", text=REMAINDER)]
    new, results = library().apply(ops, step=1, near=NearDuplicates(VECTORS, 0.9, "reject"))
    assert results[0].status.value == "rejected"
    assert results[0].reason == "near-duplicate of live experience E0 (cosine 0.960 >= 0.9)"
    assert results[1].status.value == "applied" and [e.text for e in new] == [CARRY, REMAINDER]


def test_merge_mode_folds_the_add_into_its_near_duplicate():
    ops = [Operation(op="add", text=CARRY_AGAIN, source_groups=["p7"])]
    new, results = library().apply(ops, step=1, near=NearDuplicates(VECTORS, 0.9, "merge"))
    assert results[0].status.value == "applied" and results[0].result_id == "E0"
    assert results[0].reason.startswith("near-duplicate of live experience E0 (cosine 0.960 >= 0.9): merged")
    assert [(e.id, e.text, e.source_groups) for e in new] == [("E0", CARRY, ["p7"])]  # text kept, ids stable


def test_a_modify_is_compared_with_the_other_experiences_only():
    lib = ExperienceLibrary.from_mapping({"E0": CARRY, "E1": REMAINDER})
    near = NearDuplicates(VECTORS, 0.9, "merge")
    _, own = lib.apply([Operation(op="modify", target_ids=["E0"], text=CARRY_AGAIN)], step=1, near=near)
    assert own[0].status.value == "applied"  # rephrasing itself is not a duplicate
    _, other = lib.apply([Operation(op="modify", target_ids=["E1"], text=CARRY_AGAIN)], step=1, near=near)
    assert other[0].status.value == "rejected" and "of live experience E0" in other[0].reason


def test_a_lower_threshold_catches_more():
    ops = [Operation(op="add", text=REMAINDER)]
    _, strict = library().apply(ops, step=1, near=NearDuplicates(VECTORS, 0.9))
    _, loose = library().apply(ops, step=1, near=NearDuplicates(VECTORS, -0.5))
    assert strict[0].status.value == "applied" and loose[0].status.value == "rejected"


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("mode", ["reject", "merge"])
async def test_a_run_rejects_or_merges_a_near_duplicate_lesson_and_caches_embeddings(tmp_path, mode):
    sums = next(f for f in FAMILIES if f.name == "sums")
    # a paraphrase of the sums lesson without its key phrase: the scripted learner proposes the lesson itself
    paraphrase = "When adding multi-digit numbers, align the digits by their place value and carry."
    assert sums.key not in paraphrase
    start = tmp_path / "start.txt"
    start.write_text(f"[E0]. {paraphrase}\n")
    dataset = write_jsonl(make_problems(n_per_family=3, seed=3), tmp_path / "train.jsonl")
    embeddings = EmbeddingServer(vector=bag_of_words)
    try:
        with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
            model = ModelConfig(
                model="scripted",
                base_url=server.base_url,
                api_key_env=None,
                max_tokens=256,
                retry_base_delay_s=0.01,
                retry_max_delay_s=0.05,
                timeout_s=10,
            )
            cfg = RunConfig(
                run_id=f"near-{mode}",
                db_path=str(tmp_path / "runs.duckdb"),
                initial_library=str(start),
                dataset=DatasetConfig(path=str(dataset), seed=1),
                policy=model,
                grpo=GRPOConfig(group_size=4, epochs=2, batch_size=12, rollout_chunk_size=4),
                learning=LearningConfig(consolidate_chunk_size=3, summarize_chunk_size=4),
                concurrency=8,
                library=LibraryConfig(
                    near_duplicates=mode,
                    near_duplicate_similarity=0.9,
                    embedding=EmbeddingConfig(
                        backend="openai", model="bow", base_url=embeddings.base_url, api_key_env=None
                    ),
                ),
            )
            result = await train(cfg)
        embedded_texts = [t for r in embeddings.requests for t in r["body"]["input"]]
    finally:
        embeddings.close()

    with Store(cfg.db_path, read_only=True) as store:
        ops = store.records("operations", cfg.run_id)
        lib = store.load_library(cfg.run_id)
        cached = int(store.query("SELECT count(*) FROM embeddings WHERE model LIKE 'openai:bow%'").iloc[0, 0])
    near = [r for r in ops if r.reason.startswith("near-duplicate")]
    assert near and all(r.operation.text == sums.lesson for r in near)
    assert near[0].reason.startswith("near-duplicate of live experience E0 (cosine 0.9")
    assert sum(s.near_duplicates for s in result.steps) == len(near) and result.steps[0].duplicate_ratio > 0
    texts = [e.text for e in lib]
    assert sums.lesson not in texts and paraphrase in texts  # the library keeps one of the two
    if mode == "reject":
        assert all(r.status.value == "rejected" for r in near)
    else:
        assert all(r.status.value == "applied" and r.result_id == "E0" for r in near)
        assert lib.by_id["E0"].source_groups  # the proposing groups joined the kept lesson
    # every distinct text was embedded once: the second step asked only for texts it had not seen
    assert len(embedded_texts) == len(set(embedded_texts)) == cached
