"""benchmarks/learning.py's bookkeeping: placebos matched in number and length, results of separate
invocations merged into one report, the report naming every family, seed, lesson and command."""

import importlib.util
import json
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from clgrpo.storage.store import Store
from schemas.records import LLMCall

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("learning_benchmark", ROOT / "benchmarks" / "learning.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclasses look their module up
spec.loader.exec_module(bench)


def settings(tmp_path: Path, families: list[str], seeds: list[int]) -> "bench.Settings":
    s = bench.Settings(families, seeds, ["same"], 20, 24, 4, 4, 1, 2, 3, 2, 0.1, 0.3, tmp_path)
    s.runs_dir = tmp_path / "kept"  # never the repository's
    return s


def interval(value: float) -> dict:
    return {"value": value, "low": value - 0.1, "high": value + 0.1}


def result(s: "bench.Settings", family: str, gain: float) -> dict:
    seeds = [
        {
            "seed": seed,
            "run_id": f"{family}-s{seed}",
            "learned": interval(0.5),
            "placebo": interval(0.3),
            "learned_minus_none": interval(gain),
            "learned_minus_placebo": interval(gain),
            "lessons": [f"Lesson {seed} about {family} ranges and counting."],
            "placebo_lessons": [],
            "train_seconds": 600.0,
            "tokens": 1000,
            "tokens_by_part": {"rollouts": 500, "learner": 300, "validation": 200},
            "kept": 1,
            "rejected_by_validation": 2,
            "rejected_other": 0,
            "heldout_in_training": 0,
            "lessons_without_learner": 0,
        }
        for seed in s.seeds
    ]
    return {
        "family": family,
        "learner": "same",
        "command": f"python benchmarks/learning.py --families {family}",
        "measured": "2026-11-25",
        "settings": {
            "seeds": s.seeds,
            "train": s.train,
            "group_size": 4,
            "epochs": 1,
            "candidates": 2,
            "trial_problems": 2,
            "trial_samples": 3,
            "min_gain": 0.1,
            "eval_temperature": 0.3,
        },
        "eval_ids": {"none": "e0"},
        "problems": 24,
        "k": 4,
        "none": interval(0.3),
        "baseline_parsed": 1.0,
        "seeds": seeds,
        "pooled": {
            "learned": interval(0.5),
            "placebo": interval(0.3),
            "learned_minus_none": interval(gain),
            "learned_minus_placebo": interval(gain),
        },
        "tokens_per_point": 100.0 if gain > 0 else None,
        "eval_minutes": 7.0,
        "train_seconds": 1800.0,
    }


def test_placebo_has_as_many_lessons_of_about_the_same_length():
    pool = ["one two three four five six", "a b c d e f g h i j k l", "x y z w v u t s r q p o n m l k j i h g"]
    learned = ["seven words in this learned lesson here", "twelve words " * 6]
    chosen = bench.placebo(learned, pool)
    assert chosen == [pool[0], pool[1]]
    assert bench.placebo(["w " * 5] * 5, pool[:2]) == pool[:2]  # a small pool: as many as it has


def test_separate_invocations_merge_into_one_report(tmp_path):
    ranges = settings(tmp_path, ["ranges"], [0, 1, 2])
    percent = settings(tmp_path, ["percent"], [0])
    bench.save_results(ranges, [result(ranges, "ranges", 0.2)], 90.0)
    merged = bench.save_results(percent, [result(percent, "percent", -0.05)], 40.0)
    assert [r["family"] for r in merged] == ["ranges", "percent"]
    again = bench.save_results(percent, [result(percent, "percent", 0.01)], 41.0)  # measured again: replaced
    assert [(r["family"], r["pooled"]["learned_minus_none"]["value"]) for r in again] == [
        ("ranges", 0.2),
        ("percent", 0.01),
    ]
    assert len(json.loads((tmp_path / "results.json").read_text())["results"]) == 2
    text = bench.markdown(again)
    assert "| ranges | same | 0, 1, 2 | 20 / 24 x 4 |" in text and "| percent | same | 0 | 20 / 24 x 4 |" in text
    assert "--families ranges" in text and "--families percent" in text
    assert '"Lesson 2 about ranges ranges and counting."' in text
    assert "percent/same: 100" in text and "percent/same: no gain" in bench.markdown(merged)
    bench.plot(again, tmp_path / "learning.png")
    assert (tmp_path / "learning.png").stat().st_size > 0


def test_sampling_minutes_come_from_the_stored_calls(tmp_path):
    s = settings(tmp_path, ["ranges"], [0])
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    calls = {
        "e0": [
            LLMCall(stage="evaluate", role="policy", model="m", started_at=t0, latency_s=30.0),
            LLMCall(stage="evaluate", role="policy", model="m", started_at=t0 + timedelta(seconds=10), latency_s=10.0),
            LLMCall(stage="evaluate", role="policy", model="m", started_at=t0 + timedelta(seconds=20), latency_s=40.0),
            # resumed 40 minutes later: the pause is not sampling
            LLMCall(stage="evaluate", role="policy", model="m", started_at=t0 + timedelta(minutes=40), latency_s=30.0),
        ],
        # made together, sent one after the other (each waited its turn): 30 s of sampling, not 10
        "e1": [
            LLMCall(stage="evaluate", role="policy", model="m", started_at=t0, waited_s=w, latency_s=10.0)
            for w in (0.0, 10.0, 20.0)
        ],
        "other": [LLMCall(stage="evaluate", role="policy", model="m", started_at=t0, latency_s=600.0)],
    }
    with Store(str(tmp_path / "learning.duckdb")) as store:
        for run_id, rows in calls.items():
            store.write_stage(run_id, 0, "evaluate", {"llm_calls": rows})
    # e0: calls in flight from 0 s to 60 s (overlapping), then 30 s after the pause; e1: 30 s; "other" not asked
    assert np.isclose(bench.sampling_minutes(s, {"none": "e0", "learned": "e1"}), 2.0)


def test_the_estimate_counts_the_runs_left_to_do_and_their_samples(tmp_path):
    s = settings(tmp_path, ["ranges", "percent"], [0, 1, 2])
    minutes, how = bench.estimate_minutes(s)
    # 6 training runs of the policy as its own learner, 2 families' "none" and oracle lesson, and a learned, a
    # placebo and a k-shot library per run: (2 + 2 + 3 x 6) x 24 problems x k=4
    assert how.startswith("6 of 6 training runs to do") and "2,112 evaluation samples" in how
    assert minutes == 6 * bench.MINUTES_PER_TRAINING_RUN["same"] + 2112 * bench.SECONDS_PER_EVAL_SAMPLE / 60
    s.kshot = 0  # no k-shot condition: two per run
    assert "1,536 evaluation samples" in bench.estimate_minutes(s)[1]  # (2 + 2 + 2 x 6) x 24 x 4
    # the product's gate defaults go into the run config unless one is given on the command line
    assert bench.gate_section(s) == {"enabled": "auto"}
    assert bench.gate_section(bench.Settings(**{**s.__dict__, "gate": "off", "gate_samples": 2})) == {
        "enabled": False,
        "samples": 2,
    }


def test_each_seed_is_kept_as_a_file_and_a_later_invocation_pools_from_them(tmp_path, capsys):
    s = settings(tmp_path, ["ranges"], [0, 1])
    none = {
        "family": "ranges",
        "problems": ["a", "b", "c"],
        "matrix": [[0.0, 0.0]] * 3,
        "parsed": 1.0,
        "eval_minutes": 1.0,
    }
    bench.keep(s, "ranges-none", none)
    run = bench.TrainRun("ranges", "same", 0, "ranges-self-s0", 60.0, 100, 50, 30, 20, lessons=["Add one."])
    learned = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    entry = bench.seed_entry(run, np.zeros((3, 2)), learned, np.zeros((3, 2)), ["Be careful."], 0.5)
    assert entry["checks_cost"] == (100 + 50 + 30 + 20) / (100 + 50)
    bench.keep(s, "ranges-self-s0", {"family": "ranges", "learner": "same", **entry})
    second = {**entry, "seed": 1, "run_id": "ranges-self-s1", "lessons": []}
    second["matrices"] = {"learned": none["matrix"], "placebo": none["matrix"]}  # learned nothing: the same draws
    bench.keep(s, "ranges-self-s1", second)
    # another invocation (another machine: no database in --out) reads both seeds back instead of training them
    kept = [bench.family_seed(s, "ranges", "same", seed, {}, {}, none) for seed in (0, 1)]
    assert "ranges-self-s0: measured on " in capsys.readouterr().out
    pooled = bench.pool_family(s, "ranges", "same", bench.load_kept(s, "ranges-none"), kept, "cmd")
    assert pooled["pooled"]["learned_minus_none"]["value"] == 0.25  # (0.5 + 0) / 2 over 3 problems x 2 samples
    today = time.strftime("%Y-%m-%d")  # when the kept parts were measured, not when they were pooled
    assert pooled["measured"] == today
    dated = [{**kept[0], "measured": "2026-11-27"}, kept[1]]
    assert bench.pool_family(s, "ranges", "same", none, dated, "cmd")["measured"] == f"2026-11-27 to {today}"
    assert [x["seed"] for x in pooled["seeds"]] == [0, 1] and "matrices" not in pooled["seeds"][0]
    assert pooled["tokens_per_point"] == 2 * 200 / 25
    assert bench.estimate_minutes(s)[1].startswith("0 of 2 training runs to do")
    assert bench.save_results(s, [pooled], 1.0)[0]["family"] == "ranges"  # results.json takes it as it is
    another = settings(tmp_path, ["ranges"], [0])
    another.k = 8  # other settings: another folder, nothing read back
    assert bench.results_dir(another) != bench.results_dir(s) and bench.load_kept(another, "ranges-none") is None


def test_the_glance_table_gives_each_family_its_verdict_and_marks_the_held_back_ones(tmp_path):
    s = settings(tmp_path, ["ranges"], [0, 1, 2])
    gain, harm, flat = result(s, "ranges", 0.2), result(s, "percent", -0.05), result(s, "posts", 0.05)
    empty = result(s, "units", 0.0)
    for x in empty["seeds"]:
        x["lessons"] = []
    gain["seeds"][0]["gate"] = ["step 1: library gate: ...: adopted, better beyond noise", "step 2: ...: rejected, x"]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in bench.glance([gain, harm, flat, empty]).splitlines()}
    assert rows["ranges"].endswith("| gain |") and "| 1/2 / off / off |" in rows["ranges"]
    assert rows["percent"].endswith("| HARM |")  # the point estimate below -0.02
    assert rows["posts (held back)"].endswith("| no harm, no clear gain |")  # its CI holds 0
    assert "arithmetic" not in bench.HELD_BACK  # issue 42's held-back families were run in its final report
    assert rows["units"].endswith("| no lesson kept (no harm) |") and "| 0 / 0 / 0 |" in rows["units"]
    one = result(s, "handshakes", 0.2)  # issue 57: a pooled gain that one seed carries is not a gain
    for x, value in zip(one["seeds"], (0.0, 0.0, 0.3)):
        x["learned_minus_none"] = interval(value)
    assert bench.verdict(one) == "gain carried by one seed"
    one["seeds"][1]["learned_minus_none"] = interval(0.01)
    assert bench.verdict(one) == "gain"
    bench.glance_plot([gain, harm, flat, empty], tmp_path / "glance.png")
    assert (tmp_path / "glance.png").stat().st_size > 0
    assert bench.lessons_caption(empty) == "lessons 0/0/0: none kept"


def test_the_pictures_caption_counts_each_seeds_lessons_and_quotes_the_shortest_cut_between_words(tmp_path):
    r = result(settings(tmp_path, ["ranges"], [0, 1]), "ranges", 0.2)
    r["seeds"][0]["lessons"] = ["Count both ends of a range: last - first + 1, including the upper bound day."]
    r["seeds"][1]["lessons"] = ["Convert units before adding quantities of different units together.", "Check."]
    assert bench.lessons_caption(r) == "lessons 1/2: \u201cCheck.\u201d"
    r["seeds"][1]["lessons"] = []
    assert bench.lessons_caption(r, width=40) == "lessons 1/0: \u201cCount both ends of a range: last - \u2026\u201d"


def test_trials_off_asks_one_candidate_per_group_and_gates_alone(tmp_path):
    off, _ = bench.parse(["--trials", "off", "--candidates", "3", "--out", str(tmp_path)])
    config = bench.train_config(off, "train.jsonl", 0, "http://p", "http://l", "l")["learning"]
    assert off.candidates == 1 and config["candidates"] == 1 and config["lesson_validation"]["enabled"] is False
    on, _ = bench.parse(["--out", str(tmp_path)])
    assert bench.train_config(on, "train.jsonl", 0, "http://p", "http://l", "l")["learning"]["lesson_validation"][
        "enabled"
    ]
    assert bench.results_dir(on) != bench.results_dir(off)  # kept apart


def test_a_setting_added_later_keeps_the_folders_of_results_kept_before(tmp_path):
    # as results were kept before: worked examples were off then (the product's default since issue 57 is
    # rationalize, and the benchmark's follows it: --examples off finds those folders)
    before, _ = bench.parse(["--out", str(tmp_path), "--trial-order", "plan", "--examples", "off"])
    added = {"gate_temperature", "trial_order", "examples", "examples_shown", "examples_as"}  # at their earlier values
    key = json.dumps({k: getattr(before, k) for k in bench.RESULT_SETTINGS if k not in added}, sort_keys=True)
    assert bench.results_dir(before).name == bench.hashlib.sha256(key.encode()).hexdigest()[:12]  # as it was
    cooler, _ = bench.parse(["--out", str(tmp_path), "--trial-order", "plan", "--gate-temperature", "0.3"])
    assert bench.results_dir(cooler) != bench.results_dir(before)
    assert bench.gate_section(cooler) == {"enabled": "auto", "temperature": 0.3}
    supported, _ = bench.parse(["--out", str(tmp_path), "--examples", "off"])  # the product's order now: support
    assert bench.results_dir(supported) != bench.results_dir(before)
    examples, _ = bench.parse(["--out", str(tmp_path), "--trial-order", "plan"])  # the product's default now
    assert examples.examples == "rationalize" and bench.results_dir(examples) != bench.results_dir(before)


def test_trials_and_the_gate_alone_side_by_side_from_the_kept_results(tmp_path):
    s, mode = bench.parse(["--families", "ranges", "--seeds", "0", "--compare-trials", "--out", str(tmp_path)])
    s.runs_dir = tmp_path / "kept"
    assert mode.compare_trials and not mode.report
    none = {"family": "ranges", "problems": ["a", "b"], "matrix": [[0.0, 0.0]] * 2, "parsed": 1.0, "eval_minutes": 1.0}
    run = bench.TrainRun("ranges", "same", 0, "ranges-self-s0", 60.0, 100, 50, 30, 20, lessons=["Add one."])
    learned = np.array([[1.0, 1.0], [1.0, 0.0]])
    entry = bench.seed_entry(run, np.zeros((2, 2)), learned, np.zeros((2, 2)), ["Be careful."], 0.5)
    on = bench.Settings(**{**s.__dict__, "trials": "on"})
    bench.keep(on, "ranges-none", none)
    bench.keep(on, "ranges-self-s0", {"family": "ranges", "learner": "same", **entry})
    table = bench.trials_comparison(s)
    assert "| ranges | same | on | 0 | +0.750 [" in table and "| 200 | 3 | 1.33x |" in table  # 200 tokens, 75 points
    assert "| same | off |" not in table  # nothing kept for the gate alone: no row


def test_a_run_that_kept_no_lesson_is_the_none_condition_not_another_draw(tmp_path):
    """Issue 47: the empty library drawn again read as a gain (+0.03 over none, '23,255 tokens per point'); a run
    that ended with no lesson is measured once, as none, whatever a result kept before holds."""
    s = settings(tmp_path, ["ranges"], [0])
    base = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    none = {"family": "ranges", "problems": ["a", "b", "c"], "matrix": base.tolist(), "parsed": 1.0}
    none["eval_minutes"] = 1.0
    run = bench.TrainRun("ranges", "same", 0, "ranges-self-s0", 60.0, 100, 50, 30, 20, lessons=[])
    redrawn = np.array([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])  # the same empty prompt, drawn again: noise
    entry = bench.seed_entry(run, base, redrawn, redrawn, [], 0.5)
    assert entry["learned_minus_none"]["value"] > 0  # what the redraw alone would report
    pooled = bench.pool_family(s, "ranges", "same", none, [entry], "cmd")
    assert pooled["pooled"]["learned_minus_none"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert pooled["seeds"][0]["learned_minus_placebo"]["value"] == 0.0 and pooled["tokens_per_point"] is None


def test_a_stopped_benchmark_stops_the_clgrpo_run_it_started(tmp_path):
    """SIGTERM to the benchmark reaches its clgrpo run as SIGTERM (so the run stores its finished work), and the
    benchmark exits instead of leaving the run going on its own (seen: a killed queue left `clgrpo train` running,
    which then refused the rerun: "run ... is being trained by process N")."""
    import os
    import signal
    import subprocess
    import time

    marker = tmp_path / "stopped"
    fake = tmp_path / "clgrpo"
    fake.write_text(f"#!/bin/bash\ntrap 'echo stopped > {marker}; exit 143' TERM\necho started\nsleep 60 & wait\n")
    fake.chmod(0o755)
    script = (
        "import importlib.util, sys; from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(ROOT / 'benchmarks' / 'learning.py')!r})\n"
        "b = importlib.util.module_from_spec(spec); sys.modules['b'] = b; spec.loader.exec_module(b)\n"
        f"sys.executable = {str(tmp_path / 'python')!r}  # the benchmark runs the clgrpo beside it\n"
        f"b.stop_on_sigterm(); b.clgrpo('train', log=Path({str(tmp_path / 'run.log')!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    log, deadline = tmp_path / "run.log", time.monotonic() + 60
    while not (log.exists() and "started" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text().strip() == "stopped"  # the run got SIGTERM, not SIGKILL


# --- issue 57: the oracle lesson, k-shot and items by kind -------------------------------------------------------
def stored_run(db: Path, run_id: str, outcomes: dict[str, list[float | None]]) -> None:
    """A training run's problems, rollouts and rewards as `clgrpo train` stores them (problem -> sample rewards;
    None: a failed rollout, not graded)."""
    from schemas.records import Problem, Reward, Rollout, Turn

    problems = [Problem(problem_id=p, problem=f"Problem {p}?", answer="7") for p in outcomes]
    rollouts, rewards = [], []
    for p, graded in outcomes.items():
        for j, reward in enumerate(graded):
            text = f"{p} sample {j}: so \\boxed{{{7 if reward else 8}}}"
            rollouts.append(
                Rollout(
                    problem_id=p,
                    sample_idx=j,
                    prompt_hash="h",
                    library_version=0,
                    turns=[Turn(kind="assistant", content=text)],
                )
            )
            rewards.append(
                Reward(problem_id=p, sample_idx=j, reward=reward, error=None if reward is not None else "timeout")
            )
    with Store(str(db)) as store:
        store.write_stage(run_id, 0, "load_dataset", {"problems": problems})
        store.write_stage(run_id, 1, "rollout", {"rollouts": rollouts})
        store.write_stage(run_id, 1, "verify", {"rewards": rewards})


def test_kshot_draws_k_solved_problems_at_random_from_the_runs_correct_rollouts_alone(tmp_path):
    outcomes = {f"ranges-train0-{i}": [1.0, 0.0, 1.0, 0.0] for i in range(6)}
    outcomes |= {"ranges-train0-6": [0.0, 0.0, 0.0, 0.0], "ranges-train0-7": [None, 0.0, 0.0, 0.0]}
    stored_run(tmp_path / "learning.duckdb", "ranges-l15-s0", outcomes)
    with Store(str(tmp_path / "learning.duckdb"), read_only=True) as store:
        solved = bench.solved_rollouts(store, "ranges-l15-s0")
    assert len(solved) == 12 and {x.sample_idx for x in solved} == {0, 2}  # reward 1 only: no failed, no wrong
    assert all(x.text.endswith("\\boxed{7}") and x.answer == "7" for x in solved)
    drawn = bench.kshot_draw(solved, 2, "clgrpo-kshot-ranges-l15-s0")
    assert drawn == bench.kshot_draw(list(reversed(solved)), 2, "clgrpo-kshot-ranges-l15-s0")  # seeded
    assert len({x.problem_id for x in drawn}) == 2
    draws = {tuple((x.problem_id, x.sample_idx) for x in bench.kshot_draw(solved, 2, f"seed {i}")) for i in range(30)}
    assert len(draws) > 10  # another seed, another draw: at random, not the first ones
    assert {p for d in draws for p, _ in d} == {f"ranges-train0-{i}" for i in range(6)}  # never an unsolved one
    few = [x for x in solved if x.problem_id == "ranges-train0-3"]
    assert [x.problem_id for x in bench.kshot_draw(few, 2, "s")] == ["ranges-train0-3"]  # fewer than k: all
    assert bench.kshot_draw([], 2, "s") == []


def test_the_kshot_library_file_holds_worked_examples_and_records_how_many(tmp_path):
    s = settings(tmp_path, ["ranges"], [0])
    stored_run(
        tmp_path / "learning.duckdb", "ranges-self-s0", {"ranges-train0-0": [0.0, 1.0], "ranges-train0-1": [0.0]}
    )
    run = bench.TrainRun("ranges", "same", 0, "ranges-self-s0", 60.0)
    kshot = bench.kshot_library(s, run)  # k=2, one problem solved: one example
    assert kshot.asked == 2 and kshot.problems == ["ranges-train0-0"]
    payload = json.loads(kshot.path.read_text())
    assert payload == {
        "experiences": {
            "E0": {
                "kind": "example",
                "problem": "Problem ranges-train0-0?",
                "text": "ranges-train0-0 sample 1: so \\boxed{7}",
                "answer": "7",
                "author": bench.POLICY.fetch_key,
                "reward": 1.0,
                "task_tag": "ranges",
                "source_groups": ["ranges-train0-0"],
            }
        },
        "next_id": 1,
    }
    stored_run(tmp_path / "learning.duckdb", "ranges-self-s1", {"ranges-train1-0": [0.0, 0.0]})
    none = bench.kshot_library(s, bench.TrainRun("ranges", "same", 1, "ranges-self-s1", 60.0))
    assert none.path is None and none.problems == []  # nothing solved: the k-shot condition is the none one


def test_every_family_has_one_oracle_lesson_written_as_a_one_lesson_library(tmp_path):
    from clgrpo.experience.library import ExperienceLibrary
    from domains.math.synthetic import FAMILIES

    assert set(bench.ORACLE_LESSONS) == set(FAMILIES)
    s = settings(tmp_path, list(FAMILIES), [0])
    for family, lesson in bench.ORACLE_LESSONS.items():
        assert 8 <= len(lesson.split()) <= 60 and lesson.count(". ") == 0  # one sentence
        path = bench.oracle_file(s, family)
        assert json.loads(path.read_text()) == {"E0": lesson}  # the reference format
        assert [e.text for e in ExperienceLibrary.load(path)] == [lesson]
    assert len({bench.oracle_label(f) for f in FAMILIES}) == len(FAMILIES)


def test_items_are_counted_by_kind_and_an_item_without_one_is_a_lesson():
    from types import SimpleNamespace

    from clgrpo.experience.library import ExperienceLibrary

    lessons = list(ExperienceLibrary.from_mapping({"E0": "Add one.", "E1": "Count both ends."}))
    assert bench.items_by_kind(lessons) == {"lessons": 2, "examples": 0}  # today's items have no kind: lessons
    mixed = [*lessons, SimpleNamespace(kind="example"), SimpleNamespace(kind="lesson")]
    assert bench.items_by_kind(mixed) == {"lessons": 3, "examples": 1}


def test_kshot_and_the_oracle_are_pooled_and_reported_beside_results_kept_before_them(tmp_path):
    s = settings(tmp_path, ["ranges"], [0, 1])
    base = np.zeros((3, 2))
    none = {"family": "ranges", "problems": ["a", "b", "c"], "matrix": base.tolist(), "parsed": 1.0}
    none["eval_minutes"] = 1.0
    oracle = {**none, "lesson": bench.ORACLE_LESSONS["ranges"], "matrix": np.ones((3, 2)).tolist(), "eval_minutes": 2.0}
    run = bench.TrainRun("ranges", "same", 0, "ranges-self-s0", 60.0, 100, 50, lessons=["Add one."])
    run.items = {"lessons": 1, "examples": 0}
    learned = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    shots = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    kshot = bench.KShot(2, ["ranges-train0-3", "ranges-train0-9"], tmp_path / "k.json", shots)
    first = bench.seed_entry(run, base, learned, base, ["Be careful."], 0.5, kshot)
    assert first["learned_minus_kshot"]["value"] == pytest.approx(2 / 6) and first["items_kept"]["lessons"] == 1
    # seed 1 kept no lesson and solved nothing: learned, placebo and k-shot are all the none measurement
    empty = bench.TrainRun("ranges", "same", 1, "ranges-self-s1", 60.0, 100, 50, lessons=[])
    second = bench.seed_entry(empty, base, base, base, [], 0.0, bench.KShot(2, [], None))
    assert second["kshot_is_none"] and second["matrices"]["kshot"] == base.tolist()
    pooled = bench.pool_family(s, "ranges", "same", none, [first, second], "cmd", oracle)
    assert pooled["pooled"]["learned_minus_kshot"]["value"] == pytest.approx(2 / 12)
    assert pooled["oracle_minus_none"]["value"] == 1.0 and pooled["eval_minutes"] == 1.0 + 2.0 + 0.5
    old = {k: v for k, v in first.items() if "kshot" not in k and k != "items_kept"}  # as kept before issue 57
    old["matrices"] = {k: first["matrices"][k] for k in ("learned", "placebo")}
    before = bench.pool_family(s, "ranges", "same", none, [old], "cmd")
    assert before["pooled"]["learned_minus_kshot"] is None and before["oracle_minus_none"] is None
    other_k = settings(tmp_path, ["ranges"], [0, 1])
    other_k.kshot = 3  # seeds measured with k=2 do not stand for k=3
    assert (
        bench.pool_family(other_k, "ranges", "same", none, [first, second], "cmd")["pooled"]["learned_minus_kshot"]
        is None
    )
    rows = bench.glance([pooled, before]).splitlines()
    assert "| +0.167 [" in rows[2] and "| +1.000 [+1.000, +1.000] | 1 / 0 | 1+0 / 0+0 |" in rows[2]
    assert "| - | - | 1 | - |" in rows[3]  # kept before issue 57: no k-shot, no oracle, no kinds
    text = bench.markdown([pooled, before])
    assert "| 2 of 2 |" in text and "| 0 of 2 (= none) |" in text and "over 8 conditions" in text  # none, oracle, 2 x 3
    assert f'- ranges: "{bench.ORACLE_LESSONS["ranges"]}"' in text
    assert bench.lessons_caption(pooled) == "lessons+examples 1+0/0+0: \u201cAdd one.\u201d"
    assert bench.lessons_caption(before) == "lessons 1: \u201cAdd one.\u201d"
    bench.glance_plot([pooled, before], tmp_path / "glance.png")
    bench.plot([pooled, before], tmp_path / "learning.png")
    assert (tmp_path / "glance.png").stat().st_size > 0 and (tmp_path / "learning.png").stat().st_size > 0


def test_the_ten_family_reports_kept_results_still_read_and_show_dashes_for_the_new_columns(tmp_path):
    folder = bench.RUNS_DIR / "74451bb18c29"
    kept = json.loads((folder / "settings.json").read_text())  # kept before the settings added later existed:
    kept = {**bench.LATER_RESULT_SETTINGS, **kept}  # measured at their earlier values (worked examples off)
    s = bench.Settings(["ranges"], [0, 1, 2], ["qwen2.5-coder-1.5b"], out=tmp_path, **kept)
    assert bench.results_dir(s) == folder  # the k-shot setting is not in a folder's key
    r = bench.kept_family(s, "ranges", "qwen2.5-coder-1.5b")
    assert r["pooled"]["learned_minus_none"]["value"] == pytest.approx(0.479, abs=1e-3)  # as reported
    row = bench.glance([r]).splitlines()[2]
    assert "| - | - | 1 / 1 / 2 | - / - / - |" in row and row.endswith("| gain |")
    assert "over 7 conditions" in bench.markdown([r])  # none and 2 per seed, as reported


def test_the_benchmark_refuses_k_shot_before_library_files_hold_examples(tmp_path, monkeypatch):
    """Until `clgrpo eval --library` reads worked examples, a k-shot condition could not be evaluated: the benchmark
    says so before it trains anything, and --kshot 0 runs without it."""
    monkeypatch.setattr(bench, "examples_readable", lambda: False)
    with pytest.raises(SystemExit, match="--kshot 0 runs without it"):
        bench.main(["--families", "ranges", "--seeds", "0", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_worked_example_gets_a_placebo_about_as_long():
    pool = [" ".join(f"w{i}" for i in range(n)) for n in (8, 10, 12, 30, 35, 40)]
    lesson, example = "a b c d e f g h i j", " ".join(["word"] * 100)
    short, long_ = bench.placebo([lesson, example], pool)
    assert short == pool[1]  # a lesson: the one closest in length, as before
    assert 80 <= bench.word_count(long_) <= 120  # an example: pool lessons joined to about its length
