"""Retrieval injection, domain routing, the token budget and per-version quality metrics, as units: what each
problem's prompt shows, which lessons a budget evicts and why, what the quality row of a version says."""

from __future__ import annotations

import json

import pytest

from clgrpo.experience.library import ExperienceLibrary, normalize_text
from clgrpo.experience.quality import library_quality
from clgrpo.experience.retrieval import select_experiences
from clgrpo.experience.tokens import estimate_tokens
from clgrpo.inputs.dataset import DatasetError, load_problems
from clgrpo.llm.structured import StructuredOutputError, parse_operations
from clgrpo.storage.store import Store
from schemas.config import DatasetConfig, LibraryConfig, RunConfig
from schemas.records import Experience, ExperienceStat, Operation, OpKind, Problem, Summary

CARRY = "When adding numbers, carry the tens digit to the next column."
BORROW = "When subtracting, borrow from the next column if the top digit is smaller."
SPLIT = "When multiplying, split a factor into tens and ones and add the parts."
UNITS = "Always write the units of the answer after checking them twice."


def lib(*texts: str, tags: tuple[str | None, ...] = (), step: int = 0) -> ExperienceLibrary:
    tags = tags or (None,) * len(texts)
    return ExperienceLibrary(
        [
            Experience(id=f"E{i}", text=t, created_step=step, updated_step=step, domain_tag=tag)
            for i, (t, tag) in enumerate(zip(texts, tags))
        ]
    )


def problem(pid: str, text: str, tag: str | None = None) -> Problem:
    return Problem(problem_id=pid, problem=text, answer="1", domain_tag=tag)


# --- rendering and selection -------------------------------------------------------------------------------
def test_a_routed_prompt_shows_only_its_ids_in_id_order():
    library = lib(CARRY, BORROW, SPLIT).with_shown({"p1": ["E2", "E0"]})
    assert library.prompt_text_for("p1") == f"[E0]. {CARRY}\n[E2]. {SPLIT}"
    assert library.prompt_text_for("other") == library.render_for_prompt()  # unrouted problems see all
    assert ExperienceLibrary.from_version(library.to_version()).shown == {"p1": ["E2", "E0"]}


def test_without_top_k_or_tags_every_prompt_gets_the_whole_library():
    assert select_experiences(lib(CARRY, BORROW), [problem("p", "Add 2 and 3.")]) is None


def test_top_k_picks_the_most_similar_lessons_plus_the_pinned_ones():
    library = lib(CARRY, BORROW, SPLIT, UNITS)
    adding, taking = "Add 12 and 39.", "Subtract 7 from 30."
    vectors = {
        normalize_text(t): v
        for t, v in [
            (CARRY, [1, 0, 0]),
            (BORROW, [0, 1, 0]),
            (SPLIT, [0, 0, 1]),
            (UNITS, [0.2, 0.98, 0]),
            (adding, [0.9, 0.1, 0.42]),
            (taking, [0.1, 0.99, 0.1]),
        ]
    }
    shown = select_experiences(
        library, [problem("a", adding), problem("t", taking)], top_k=1, pinned=["E3"], vectors=vectors
    )
    assert shown == {"a": ["E0", "E3"], "t": ["E1", "E3"]}
    shown = select_experiences(library, [problem("a", adding)], top_k=2, pinned=["E9"], vectors=vectors)
    assert shown == {"a": ["E0", "E2"]}  # a pinned id that is not live is ignored


def test_a_missing_embedding_is_named():
    with pytest.raises(KeyError, match="no embedding for 'Add 1 and 2.'"):
        select_experiences(
            lib(CARRY, BORROW),
            [problem("a", "Add 1 and 2.")],
            top_k=1,
            vectors={normalize_text(CARRY): [1.0], normalize_text(BORROW): [0.0]},
        )


def test_a_domain_sees_its_own_and_the_shared_lessons_an_untagged_problem_sees_all():
    library = lib(CARRY, BORROW, UNITS, tags=("sums", "differences", None))
    shown = select_experiences(
        library, [problem("s", "Add.", "sums"), problem("d", "Take.", "differences"), problem("x", "Anything.")]
    )
    assert shown == {"s": ["E0", "E2"], "d": ["E1", "E2"], "x": ["E0", "E1", "E2"]}


def test_lessons_take_the_domain_of_the_problems_they_came_from():
    domains = {"s1": "sums", "s2": "sums", "d1": "differences"}
    start = lib(CARRY, BORROW, tags=("sums", "differences"))
    ops = [
        Operation(op="add", text=SPLIT, source_groups=["s1", "s2"]),
        Operation(op="add", text=UNITS, source_groups=["s1", "d1"]),
        Operation(op="modify", target_ids=["E1"], text=BORROW + " Then check.", source_groups=["d1"]),
        Operation(op="modify", target_ids=["E0"], text=CARRY + " Then check.", source_groups=["d1"]),
    ]
    new, results = start.apply(ops, step=1, domains=domains)
    assert all(r.status.value == "applied" for r in results)
    assert {e.id: e.domain_tag for e in new} == {"E0": None, "E1": "differences", "E2": "sums", "E3": None}


# --- the token budget --------------------------------------------------------------------------------------
def stat(exp_id: str, correct: float, wrong: float) -> ExperienceStat:
    return ExperienceStat(
        exp_id=exp_id,
        cited=int(correct + wrong),
        cited_correct=correct,
        cited_wrong=wrong,
        confidence=(1 + correct) / (2 + correct + wrong),
    )


def test_the_budget_evicts_the_least_useful_then_the_oldest_and_retires_their_ids():
    start = ExperienceLibrary(
        [
            Experience(id="E0", text=CARRY, created_step=1),
            Experience(id="E1", text=BORROW, created_step=2),
            Experience(id="E2", text=SPLIT, created_step=0),
            Experience(id="E3", text=UNITS, created_step=3),
        ],
        version=3,
        step=3,
    )
    stats = {"E0": stat("E0", 3, 0), "E1": stat("E1", 0, 2)}  # E2, E3: never cited (0.5); E2 is older
    line = {e.id: estimate_tokens(f"[{e.id}]. {e.text}") for e in start}
    budget = start.prompt_tokens() - line["E1"] - 1  # evicting E1 alone is not enough
    kept, results = start.evict_to_budget(budget, stats, first_seq=5)
    assert [r.result_id for r in results] == ["E1", "E2"] and [r.seq for r in results] == [5, 6]
    assert kept.prompt_tokens() <= budget and [e.id for e in kept] == ["E0", "E3"]
    assert all(r.operation.op == OpKind.EVICT and r.status.value == "applied" for r in results)
    assert results[0].reason == (
        f"over the token budget: library {start.prompt_tokens()} tokens > "
        f"library.max_tokens={budget}; lowest usefulness: confidence 0.25 (cited 2x: "
        f"0 correct / 2 wrong), created step 2; {start.prompt_tokens() - line['E1']} "
        f"tokens after"
    )
    assert "confidence 0.50 (never cited), created step 0" in results[1].reason
    assert kept.version == 3 and {"E1", "E2"} <= kept.retired_ids
    after, added = kept.apply([Operation(op="add", text="Draw a picture of the problem before you start.")], step=4)
    assert added[0].result_id == "E4"  # evicted ids are never reused


def test_a_library_within_its_budget_is_untouched():
    start = lib(CARRY, BORROW)
    assert start.evict_to_budget(start.prompt_tokens(), {}) == (start, [])


def test_the_learner_cannot_propose_an_eviction():
    with pytest.raises(StructuredOutputError, match="'evict' is not one of"):
        parse_operations(json.dumps({"operations": [{"op": "evict", "ids": ["E0"]}]}))
    _, results = lib(CARRY).apply([Operation(op=OpKind.EVICT, target_ids=["E0"])], step=1)
    assert results[0].status.value == "rejected" and "only the token budget evicts" in results[0].reason


# --- quality ----------------------------------------------------------------------------------------------
def test_the_quality_row_counts_size_tokens_confidence_coverage_and_churn():
    before = lib(CARRY, BORROW, SPLIT)
    after, results = before.apply(
        [
            Operation(op="add", text=UNITS),
            Operation(op="delete", target_ids=["E1"]),
            Operation(op="modify", target_ids=["E2"], text=SPLIT + " Check it."),
        ],
        step=1,
    )
    after, evicted = after.evict_to_budget(
        after.prompt_tokens() - 1, {"E3": stat("E3", 5, 0), "E2": stat("E2", 5, 0)}, len(results)
    )
    summaries = [
        Summary(problem_id="p1", sample_idx=0, text="The attempt followed E0 and was right."),
        Summary(problem_id="p1", sample_idx=1, text="It ignored E0."),
        Summary(problem_id="p2", sample_idx=0, text="No lesson was used."),
        Summary(problem_id="p3", sample_idx=0, text="E2 helped.", error="call failed"),
    ]
    stats = [stat("E2", 1, 1), ExperienceStat(exp_id="E3")]
    quality = library_quality(before, after, stats, results + evicted, summaries)
    assert [r.result_id for r in evicted] == ["E0"]
    assert (quality.size, quality.tokens) == (2, after.prompt_tokens())
    assert (quality.added, quality.modified, quality.deleted, quality.evicted) == (1, 1, 1, 1)
    assert quality.coverage == 0.5 and quality.coverage_problems == 2  # p1 cited E0; p2 none; p3 failed
    assert quality.mean_confidence == pytest.approx(0.5) and quality.never_cited_share == 0.5


# --- config, dataset and storage ----------------------------------------------------------------------------
def test_default_library_settings_keep_the_fingerprint_and_changed_ones_change_it(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    base = RunConfig(run_id="r", dataset=DatasetConfig(path=str(data)))
    same = base.model_copy(update={"library": LibraryConfig(top_k=3, pinned=["E1"])})  # top_k unused with "all"
    assert same.fingerprint() == base.fingerprint()
    for changed in (LibraryConfig(injection="top_k"), LibraryConfig(max_tokens=500)):
        assert base.model_copy(update={"library": changed}).fingerprint() != base.fingerprint()
    tagged = base.model_copy(update={"dataset": DatasetConfig(path=str(data), domain_field="family")})
    assert tagged.fingerprint() != base.fingerprint()


def test_the_domain_column_tags_problems_and_a_wrong_type_is_named(tmp_path):
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"id": "a", "problem": "Add 1 and 2.", "answer": "3", "family": "sums"},
        {"id": "b", "problem": "Take 1 from 2.", "answer": "1", "family": None},
        {"id": "c", "problem": "Multiply 2 by 2.", "answer": "4"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_problems(DatasetConfig(path=str(data), domain_field="family", shuffle=False))
    assert [p.domain_tag for p in problems] == ["sums", None, None]
    data.write_text(json.dumps({"id": "a", "problem": "Add.", "answer": "3", "family": ["sums"]}) + "\n")
    with pytest.raises(DatasetError, match=r"line 1.*family.*wrong type: expected text or a number \(or empty"):
        load_problems(DatasetConfig(path=str(data), domain_field="family"))


def test_domain_tags_are_stored_with_the_library_and_the_problems(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        store.save_library("r", lib(CARRY, BORROW, tags=("sums", None)))
        assert [e.domain_tag for e in store.load_library("r", 0)] == ["sums", None]
        store.write_stage("r", 0, "load_dataset", {"problems": [problem("a", "Add.", "sums"), problem("b", "Take.")]})
        assert [p.domain_tag for p in store.records("problems", "r")] == ["sums", None]
