import json
from pathlib import Path

import pytest

from clgrpo.experience.library import ExperienceLibrary, LibraryFormatError, diff
from schemas.records import Operation, OpStatus

REFERENCE = Path(__file__).resolve().parent / "data" / "reference_library_math.json"


def op(kind: str, ids=(), text=None, groups=()) -> Operation:
    return Operation(op=kind, target_ids=list(ids), text=text, source_groups=list(groups))


@pytest.fixture
def lib() -> ExperienceLibrary:
    start = ExperienceLibrary()
    new, results = start.apply(
        [
            op("add", text="Check small cases first.", groups=["p1"]),
            op("add", text="Draw a diagram for geometry.", groups=["p2"]),
            op("add", text="Verify the final answer by substitution.", groups=["p3"]),
        ],
        step=1,
    )
    assert [r.status for r in results] == [OpStatus.APPLIED] * 3
    return new


def statuses(results):
    return [(r.status.value, r.reason) for r in results]


def test_empty_library_renders_empty_and_ids_start_at_zero():
    empty = ExperienceLibrary()
    assert empty.render_for_prompt() == ""
    new, _ = empty.apply([op("add", text="A lesson.")], step=1)
    assert [e.id for e in new] == ["E0"]


def test_add_assigns_new_ids_with_lineage(lib):
    assert [e.id for e in lib] == ["E0", "E1", "E2"]
    assert lib.by_id["E1"].created_step == 1 and lib.by_id["E1"].source_groups == ["p2"]
    assert lib.version == 1 and lib.parent_version == 0


def test_modify_keeps_id_and_records_step(lib):
    new, results = lib.apply([op("modify", ["E1"], "Draw and label a diagram.", ["p9"])], step=2)
    assert statuses(results) == [("applied", "")]
    e1 = new.by_id["E1"]
    assert e1.text == "Draw and label a diagram." and e1.created_step == 1 and e1.updated_step == 2
    assert e1.source_groups == ["p2", "p9"]
    assert lib.by_id["E1"].text == "Draw a diagram for geometry."  # old version untouched


def test_delete_retires_id_and_ids_are_never_reused(lib):
    new, results = lib.apply([op("delete", ["E2"])], step=2)
    assert statuses(results) == [("applied", "")]
    assert "E2" not in new and "E2" in new.retired_ids
    newer, _ = new.apply([op("add", text="Another lesson.")], step=3)
    assert [e.id for e in newer] == ["E0", "E1", "E3"]


def test_merge_creates_new_id_with_parents(lib):
    new, results = lib.apply([op("merge", ["E0", "E2"], "Check small cases, then verify by substitution.")], step=2)
    assert results[0].status == OpStatus.APPLIED and results[0].result_id == "E3"
    merged = new.by_id["E3"]
    assert merged.parent_ids == ["E0", "E2"] and set(merged.source_groups) == {"p1", "p3"}
    assert {"E0", "E2"} <= new.retired_ids and [e.id for e in new] == ["E1", "E3"]


def test_keep_changes_nothing(lib):
    new, results = lib.apply([op("keep", ["E0"])], step=2)
    assert statuses(results) == [("applied", "")]
    assert new.as_dict() == lib.as_dict() and new.version == lib.version + 1


@pytest.mark.parametrize(
    ("operation", "reason_start"),
    [
        (op("modify", ["E9"], "x"), "unknown id: E9"),
        (op("delete", ["E77"]), "unknown id: E77"),
        (op("keep", ["nope"]), "unknown id: nope"),
        (op("merge", ["E0"], "x"), "merge needs at least 2"),
        (op("merge", ["E0", "E0"], "x"), "merge needs at least 2"),
        (op("merge", ["E0", "E42"], "x"), "unknown id: E42"),
        (op("add", text=""), "empty text"),
        (op("add", text="   "), "empty text"),
        (op("add"), "empty text"),
        (op("modify", ["E0"], " "), "empty text"),
        (op("add", text=" ".join(["word"] * 33)), "too long: 33 words (limit 32)"),
        (op("add", text="check SMALL cases   first."), "duplicate of live experience E0"),
        (op("modify", ["E1"], "Check small cases first."), "duplicate of live experience E0"),
        (op("modify", ["E1"], "Draw a diagram for geometry."), "unchanged: text identical to E1"),
        (op("add", ["E0"], "x y"), "add takes no ids"),
        (op("delete", ["E0", "E1"]), "delete takes exactly one id"),
    ],
)
def test_rejections_carry_reasons(lib, operation, reason_start):
    new, results = lib.apply([operation], step=2)
    assert results[0].status == OpStatus.REJECTED
    assert results[0].reason.startswith(reason_start), results[0].reason
    assert new.as_dict() == lib.as_dict()


def test_deleted_id_is_rejected_as_deleted(lib):
    new, _ = lib.apply([op("delete", ["E0"])], step=2)
    _, results = new.apply([op("modify", ["E0"], "Revived.")], step=3)
    assert results[0].reason == "deleted id: E0 was deleted or merged earlier"


def test_conflicting_operations_on_one_id_in_one_batch(lib):
    new, results = lib.apply(
        [
            op("modify", ["E0"], "Check tiny cases."),
            op("delete", ["E0"]),
            op("merge", ["E0", "E1"], "Merged."),
            op("keep", ["E0"]),
        ],
        step=2,
    )
    assert statuses(results)[0] == ("applied", "")
    for r in results[1:]:
        assert r.status == OpStatus.REJECTED and r.reason.startswith("conflict: E0 already changed by operation #0")
    assert new.by_id["E0"].text == "Check tiny cases." and "E1" in new


def test_duplicate_within_one_batch_is_rejected():
    new, results = ExperienceLibrary().apply([op("add", text="Same."), op("add", text="same.")], step=1)
    assert statuses(results) == [("applied", ""), ("rejected", "duplicate of live experience E0")]
    assert len(new) == 1


def test_word_limit_is_configurable(lib):
    text = "one two three four five six"
    _, results = lib.apply([op("add", text=text)], step=2, max_words=5)
    assert results[0].reason == "too long: 6 words (limit 5)"
    _, results = lib.apply([op("add", text=text)], step=2, max_words=6)
    assert results[0].status == OpStatus.APPLIED


def test_library_size_limit(lib):
    _, results = lib.apply([op("add", text="Fourth."), op("add", text="Fifth.")], step=2, max_size=4)
    assert statuses(results) == [("applied", ""), ("rejected", "library full: 4 experiences (limit 4)")]


def test_every_operation_gets_exactly_one_result(lib):
    ops = [op("add", text="New."), op("delete", ["E9"]), op("keep", ["E1"]), op("add", text="")]
    _, results = lib.apply(ops, step=2)
    assert [r.seq for r in results] == [0, 1, 2, 3]
    assert [r.operation for r in results] == ops


def test_lineage_across_versions(lib):
    v2, _ = lib.apply([op("merge", ["E0", "E1"], "Small cases and diagrams.", ["p4"])], step=2)
    v3, _ = v2.apply([op("modify", ["E3"], "Try small cases and draw diagrams.", ["p5"])], step=3)
    e3 = v3.by_id["E3"]
    assert e3.parent_ids == ["E0", "E1"] and e3.created_step == 2 and e3.updated_step == 3
    assert set(e3.source_groups) == {"p1", "p2", "p4", "p5"}
    assert (lib.version, v2.version, v3.version) == (1, 2, 3)
    assert v3.parent_version == 2


def test_diff_reports_added_removed_modified(lib):
    new, _ = lib.apply([op("add", text="Fresh."), op("delete", ["E0"]), op("modify", ["E1"], "Changed.")], step=2)
    d = diff(lib, new)
    assert [e.id for e in d.added] == ["E3"]
    assert [e.id for e in d.removed] == ["E0"]
    assert [(a.id, b.text) for a, b in d.modified] == [("E1", "Changed.")]
    assert diff(new, new).is_empty and "+ [E3] Fresh." in d.to_markdown()


def test_reference_library_imports_and_exports_identically():
    lib = ExperienceLibrary.load(REFERENCE)
    assert len(lib) == 27 and lib.id_prefix == "G" and lib.next_id == 27
    assert lib.dumps("reference") == REFERENCE.read_text(encoding="utf-8")
    new, results = lib.apply([op("add", text="A new general lesson.")], step=1)
    assert results[0].result_id == "G27"
    assert json.loads(new.dumps())["G27"] == "A new general lesson."


def test_seed_format_round_trip(tmp_path):
    lib = ExperienceLibrary.load(REFERENCE)
    deleted, _ = lib.apply([op("delete", ["G26"])], step=1)
    path = deleted.dump(tmp_path / "seed.json", fmt="seed")
    payload = json.loads(path.read_text())
    assert payload["next_id"] == 27 and "G26" not in payload["experiences"]
    back = ExperienceLibrary.load(path)
    assert back.as_dict() == deleted.as_dict() and back.next_id == 27


def test_prompt_text_round_trip(tmp_path):
    lib = ExperienceLibrary.load(REFERENCE)
    path = lib.dump(tmp_path / "library.txt", fmt="text")
    assert path.read_text().splitlines()[0].startswith("[G0]. Combinatorial enumeration")
    assert ExperienceLibrary.load(path).as_dict() == lib.as_dict()


def test_prompt_text_with_unnamed_lines_gets_fresh_ids():
    lib = ExperienceLibrary.from_prompt_text("[E4]. Known lesson.\n- A bullet lesson.\n2) A numbered lesson.\n\n")
    assert lib.as_dict() == {"E4": "Known lesson.", "E5": "A bullet lesson.", "E6": "A numbered lesson."}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"G0": ""}', "experience 'G0': text must be a non-empty string"),
        ('{"G0": 3}', "experience 'G0': text must be a non-empty string"),
        ('{"experiences": {"E0": "x"}, "next_id": "7"}', "next_id must be an integer"),
        ('{"G0": "x",', "invalid JSON at line 1"),
        ('["x"]', "experiences must be an object"),
    ],
)
def test_bad_library_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "lib.json"
    path.write_text(content)
    with pytest.raises(LibraryFormatError) as err:
        ExperienceLibrary.load(path)
    assert str(path) in str(err.value) and message in str(err.value)
