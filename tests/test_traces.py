"""Production traces as refresh problems: every feedback variant, malformed rows skipped with file:line
reasons (a 50 MB line included), redaction, the watermark, DuckDB and Parquet tables, and rewards by source."""

import json
import os
from datetime import datetime, timedelta, timezone

import duckdb
import pandas as pd
import pytest
from pydantic import ValidationError

from clgrpo.refresh.sources import SourceError, read_arrivals, select_traces
from domains import get_domain
from schemas.records import Problem, Rollout, Turn
from schemas.refresh_config import RefreshSource
from tasks.verify import agreement_rewards, verify

T0 = datetime(2026, 11, 20, 1, 0, tzinfo=timezone.utc)
MATH = get_domain("math")


def trace(question: str, reply: str | None = None, **extra) -> dict:
    row = {"messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]}
    if reply is not None:
        row["reply"] = reply
    return {**row, **extra}


def write_traces(path, rows, moment: datetime = T0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.utime(path, (moment.timestamp(), moment.timestamp()))


def take(tmp_path, cutoff=T0 + timedelta(hours=1), after=None, consumed=frozenset(), max_problems=None, **source):
    src = RefreshSource(kind="traces", path=str(tmp_path / "traces"), **source)
    return select_traces(src, MATH, cutoff, set(consumed), after, name="prod", max_problems=max_problems)


def test_every_feedback_variant_gives_its_answer_and_source(tmp_path):
    write_traces(
        tmp_path / "traces" / "day.jsonl",
        [
            trace("What is 2 + 2?", "It is \\boxed{5}.", feedback={"thumbs": -1, "reference": "4"}, id="t-ref"),
            trace("What is 3 + 3?", "6", feedback={"thumbs": "down", "correction": "The answer is 6"}, tag="arith"),
            trace("What is 4 + 4?", "So the answer is 8.", feedback={"thumbs": 1}),
            trace("What is 5 + 5?", "\\boxed{10}", feedback={"thumbs": "up"}),
            trace("What is 6 + 6?", "I think 13", feedback={"thumbs": False}),
            trace("What is 7 + 7?", "14"),  # no feedback at all: fine, no answer
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "What is 8 + 8?"}]},
                    {"role": "assistant", "content": "\\boxed{16}"},
                ],
                "feedback": {"thumbs": True},
            },
            trace("What is 9 + 9?", "18", feedback={"thumbs": True, "reference": None, "correction": None}),
        ],
    )
    taken = take(tmp_path)
    got = [(i.problem, i.answer, i.answer_source, i.rejected_answer) for i in taken.selection.inputs]
    assert got == [
        ("What is 2 + 2?", "4", "reference", "5"),
        ("What is 3 + 3?", "The answer is 6", "correction", "6"),
        ("What is 4 + 4?", "8", "thumbs_up_reply", None),
        ("What is 5 + 5?", "10", "thumbs_up_reply", None),
        ("What is 6 + 6?", None, "none", "13"),
        ("What is 7 + 7?", None, "none", None),
        ("What is 8 + 8?", "16", "thumbs_up_reply", None),  # the reply is the last assistant message
        ("What is 9 + 9?", "18", "thumbs_up_reply", None),
    ]
    inputs = taken.selection.inputs
    assert inputs[0].problem_id == "t-ref" and inputs[2].problem_id == "day-00003"  # id, else <file>-<line>
    assert inputs[1].tag == "arith" and inputs[0].tag is None
    assert {i.source for i in inputs} == {"day.jsonl"} and {i.arrived_at for i in inputs} == {T0}
    assert taken.rejects == [] and taken.watermark.watermark == T0 and taken.watermark.n_rows == 8


def test_earlier_turns_are_context_only_when_short(tmp_path):
    turns = [
        {"role": "system", "content": "secret system prompt"},
        {"role": "user", "content": "I have 3 apples."},
        {"role": "assistant", "content": "Noted."},
        {"role": "tool", "content": "ignored"},
        {"role": "user", "content": "How many after buying 2?"},
        {"role": "assistant", "content": "5"},
    ]
    long = [{"role": "user", "content": "x" * 3000}, {"role": "user", "content": "What is 1 + 1?"}]
    write_traces(tmp_path / "traces" / "a.jsonl", [{"messages": turns}, {"messages": long}])
    short, dropped = (i.problem for i in take(tmp_path).selection.inputs)
    assert short == (
        "Earlier in the conversation:\nUser: I have 3 apples.\nAssistant: Noted.\n\nQuestion:\nHow many after buying 2?"
    )
    assert dropped == "What is 1 + 1?"
    only_last = take(tmp_path, context_chars=0).selection.inputs[0].problem
    assert only_last == "How many after buying 2?"


def test_malformed_rows_are_skipped_with_file_line_reasons_and_good_rows_kept(tmp_path):
    folder = tmp_path / "traces"
    write_traces(
        folder / "a.jsonl",
        [
            trace("What is 1 + 1?", "2", feedback={"thumbs": 1}),
            "{not json\n",
            {"messages": [{"role": "assistant", "content": "hello"}]},
            "\n",  # a blank line is no row
            trace("What is 2 + 2?"),  # no feedback: fine
            {"messages": "What is 3 + 3?"},
            trace("What is 4 + 4?", feedback=["up"]),
            trace("What is 5 + 5?", feedback={"thumbs": "maybe"}),
            trace("What is 6 + 6?", created_at="yesterday-ish"),
            "[1, 2]\n",
        ],
    )
    big = folder / "b.jsonl"
    with big.open("w") as fh:  # a 50 MB line between two good ones
        fh.write(json.dumps(trace("What is 7 + 7?")) + "\n")
        fh.write('{"messages": [{"role": "user", "content": "' + "a" * 50_000_000 + '"}]}\n')
        fh.write(json.dumps(trace("What is 8 + 8?")) + "\n")
    for path in (folder / "a.jsonl", big):
        os.utime(path, (T0.timestamp(), T0.timestamp()))

    taken = take(tmp_path)
    assert [i.problem for i in taken.selection.inputs] == [
        "What is 1 + 1?",
        "What is 2 + 2?",
        "What is 7 + 7?",
        "What is 8 + 8?",
    ]
    rendered = [r.render() for r in taken.rejects]
    assert "at at" not in " ".join(rendered)
    assert rendered == [
        "a.jsonl:2: not JSON (Expecting property name enclosed in double quotes at column 2)",
        "a.jsonl:3: no user message",
        "a.jsonl:6: messages: wrong type: expected a list, got str",
        "a.jsonl:7: feedback: wrong type: expected an object, got list",
        "a.jsonl:8: feedback.thumbs: expected +1/-1, up/down or true/false, got 'maybe'",
        "a.jsonl:9: field 'created_at' is not a timestamp ('yesterday-ish')",
        "a.jsonl:10: not a JSON object (list)",
        "b.jsonl:2: line of 50,000,048 bytes, over max_line_bytes (1,000,000)",
    ]
    assert taken.watermark.n_rejected == 8 and taken.watermark.n_rows == 12
    notes = taken.message(T0)
    assert "8 trace row(s) skipped: a.jsonl:2: not JSON" in notes and "3 more (table refresh_rejects)" in notes


def test_secrets_are_redacted_from_problems_and_answers(tmp_path):
    key = "sk-proj-Zyxwvutsrqponmlkj9876"
    write_traces(
        tmp_path / "traces" / "a.jsonl",
        [
            trace(
                f"My key is {key}; what is 2 + 2?",
                "4",
                feedback={"correction": "4 (token=9f86d081884c7d659a2feaa0c55ad015)"},
            ),
            {
                "messages": [
                    {"role": "user", "content": "db at postgres://me:pa55word@db/x"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "What is 3 + 3?"},
                ]
            },
        ],
    )
    taken = take(tmp_path)
    texts = json.dumps([i.model_dump(mode="json") for i in taken.selection.inputs])
    assert key not in texts and "pa55word" not in texts and "9f86d081884c7d659a2feaa0c55ad015" not in texts
    assert "[REDACTED:api_key]" in texts and "[REDACTED:url_password]" in texts and "[REDACTED:credential]" in texts
    assert taken.watermark.n_redacted == 3 and "3 secret(s) redacted" in taken.message(T0)


def test_the_watermark_takes_only_newer_rows_and_never_loses_deferred_ones(tmp_path):
    folder = tmp_path / "traces"
    stamps = [T0 + timedelta(hours=h) for h in (1, 2, 2, 3, 30)]
    write_traces(
        folder / "log.jsonl",
        [trace(f"What is {i} + {i}?", created_at=s.isoformat()) for i, s in enumerate(stamps)],
        moment=T0 + timedelta(days=3),
    )
    night1 = T0 + timedelta(hours=12)
    capped = take(tmp_path, cutoff=night1, max_problems=2)  # takes rows 0 and 1; row 2 arrived with row 1
    assert [i.problem for i in capped.selection.inputs] == ["What is 0 + 0?", "What is 1 + 1?"]
    mark = capped.watermark.watermark
    assert mark == stamps[0]  # the latest row before the first one left for later (rows at its time come again)
    consumed = {i.problem_key for i in capped.selection.inputs}

    nxt = take(tmp_path, cutoff=night1, after=mark, consumed=consumed)
    assert [i.problem for i in nxt.selection.inputs] == ["What is 2 + 2?", "What is 3 + 3?"]
    assert nxt.selection.n_taken_before == 2 and nxt.watermark.watermark == stamps[3]  # rows 0 and 1: taken
    assert nxt.watermark.n_late == 0
    consumed |= {i.problem_key for i in nxt.selection.inputs}
    later = take(tmp_path, cutoff=T0 + timedelta(days=2), after=nxt.watermark.watermark, consumed=consumed)
    assert [i.problem for i in later.selection.inputs] == ["What is 4 + 4?"]
    # a row without its own time arrives with its file: after the cutoff here, so it waits
    write_traces(folder / "new.jsonl", [trace("What is 9 + 9?")], moment=T0 + timedelta(days=5))
    assert [i.problem for i in take(tmp_path, cutoff=T0 + timedelta(days=2)).selection.inputs][-1] == "What is 4 + 4?"


def test_traces_from_a_duckdb_table_and_a_parquet_file(tmp_path):
    rows = [
        (
            "a1",
            json.dumps([{"role": "user", "content": "What is 2 + 2?"}]),
            "4",
            json.dumps({"thumbs": "up"}),
            "arith",
            T0,
        ),
        ("a2", "not json", None, None, None, T0),
        (
            "a3",
            json.dumps([{"role": "user", "content": "What is 3 + 3?"}]),
            "7",
            json.dumps({"thumbs": -1}),
            None,
            T0 + timedelta(days=9),
        ),
    ]
    db = tmp_path / "prod.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(
            "CREATE TABLE logs (id VARCHAR, messages VARCHAR, reply VARCHAR, feedback VARCHAR, "
            "tag VARCHAR, created_at TIMESTAMPTZ)"
        )
        con.executemany("INSERT INTO logs VALUES (?, ?, ?, ?, ?, ?)", rows)
    source = RefreshSource(kind="traces", path=str(db), table="logs")
    taken = select_traces(source, MATH, T0 + timedelta(hours=1), set(), None, name="prod")
    assert [(i.problem_id, i.answer, i.answer_source, i.tag) for i in taken.selection.inputs] == [
        ("a1", "4", "thumbs_up_reply", "arith")
    ]
    assert [r.render() for r in taken.rejects] == ["logs:2: messages: not JSON (Expecting value)"]

    parquet = tmp_path / "prod.parquet"
    pd.DataFrame(
        [
            {
                "messages": [{"role": "user", "content": "What is 5 + 5?"}],
                "reply": "10",
                "feedback": {"thumbs": -1, "correction": "12"},
                "created_at": T0,
            }
        ]
    ).to_parquet(parquet)
    structs = select_traces(
        RefreshSource(kind="traces", path=str(parquet)), MATH, T0 + timedelta(hours=1), set(), None, name="prod"
    )
    assert [(i.answer, i.answer_source, i.rejected_answer) for i in structs.selection.inputs] == [
        ("12", "correction", "10")
    ]
    with pytest.raises(SourceError, match="no table or view 'nope'"):
        select_traces(RefreshSource(kind="traces", path=str(db), table="nope"), MATH, T0, set(), None, name="p")
    with pytest.raises(SourceError, match="missing: no such file or directory"):
        select_traces(RefreshSource(kind="traces", path=str(tmp_path / "missing")), MATH, T0, set(), None, name="p")


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="leave out `table`"):
        RefreshSource(kind="traces", path="x.parquet", table="t")
    with pytest.raises(ValidationError, match="max_line_bytes"):
        RefreshSource(kind="traces", path="d", max_line_bytes=10)
    assert RefreshSource(kind="traces", path="d").traces_layout == "jsonl"
    assert RefreshSource(kind="traces", path="d.duckdb", table="t").traces_layout == "duckdb"


def test_dataset_rows_keep_their_tag(tmp_path):
    path = tmp_path / "in" / "a.jsonl"
    write_traces(
        path,
        [
            {"id": "1", "problem": "What is 2 + 2?", "answer": "4", "tag": "arith"},
            {"id": "2", "problem": "What is 3 + 3?", "answer": "6"},
        ],
    )
    arrivals = read_arrivals(RefreshSource(path=str(tmp_path / "in")), MATH, T0 + timedelta(hours=1), tmp_path)
    assert [a.problem.tag for a in arrivals] == ["arith", None]


def _rollout(problem_id: str, idx: int, text: str) -> Rollout:
    return Rollout(
        problem_id=problem_id,
        sample_idx=idx,
        prompt_hash="h",
        library_version=0,
        turns=[Turn(kind="assistant", content=text)],
        tokens_in=1,
        tokens_out=1,
        latency_s=0.0,
    )


def test_rewards_name_their_source():
    problems = [
        Problem(problem_id="gt", problem="p1", answer="4"),
        Problem(problem_id="fb", problem="p2", answer="6", answer_source="correction"),
        Problem(problem_id="up", problem="p3", answer="8", answer_source="thumbs_up_reply"),
        Problem(problem_id="open", problem="p4"),
        Problem(problem_id="split", problem="p5"),
    ]
    rollouts = [_rollout("gt", 0, "\\boxed{4}"), _rollout("fb", 0, "\\boxed{5}"), _rollout("up", 0, "\\boxed{8}")]
    rollouts += [_rollout("open", i, t) for i, t in enumerate(["\\boxed{3}", "it is 3", "\\boxed{4}"])]
    rollouts += [_rollout("split", i, t) for i, t in enumerate(["\\boxed{1}", "\\boxed{2}"])]
    plain = {(r.problem_id, r.sample_idx): r for r in verify(problems, rollouts, MATH)}
    assert plain[("gt", 0)].reward_source == "ground_truth" and plain[("gt", 0)].reward == 1.0
    assert plain[("fb", 0)].reward_source == "feedback:correction" and plain[("fb", 0)].reward == 0.0
    assert plain[("up", 0)].reward_source == "feedback:thumbs_up"
    assert plain[("open", 0)].reward is None and plain[("open", 0)].reward_source is None

    voted = {(r.problem_id, r.sample_idx): r for r in verify(problems, rollouts, MATH, unlabeled="agreement")}
    assert [voted[("open", i)].reward for i in range(3)] == [1.0, 1.0, 0.0]
    assert {voted[("open", i)].reward_source for i in range(3)} == {"agreement"}
    assert voted[("split", 0)].reward is None  # 1 of 2: no majority
    assert agreement_rewards([problems[3]], rollouts[3:6], MATH)[("open", 2)].extracted == "4"


def test_a_json_error_reads_as_one_sentence():
    from clgrpo.refresh.traces import TraceError, _json_row

    with pytest.raises(TraceError, match=r"^not JSON \(Unterminated string starting at column 7\)$"):
        _json_row(b'{"a": "x')
