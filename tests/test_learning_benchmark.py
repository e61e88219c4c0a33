"""benchmarks/learning.py's bookkeeping: placebos matched in number and length, results of separate
invocations merged into one report, the report naming every family, seed, lesson and command."""

import importlib.util
import json
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from clgrpo.store import Store
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
        "e1": [LLMCall(stage="evaluate", role="policy", model="m", started_at=t0, latency_s=30.0)],
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
    # 6 training runs of the policy as its own learner, 2 families' "none" + a learned and a placebo per run
    assert how.startswith("6 of 6 training runs to do") and "1,344 evaluation samples" in how
    assert minutes == 6 * bench.MINUTES_PER_TRAINING_RUN["same"] + 1344 * bench.SECONDS_PER_EVAL_SAMPLE / 60
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
    gain, harm, flat = result(s, "ranges", 0.2), result(s, "percent", -0.05), result(s, "arithmetic", 0.05)
    empty = result(s, "units", 0.0)
    for x in empty["seeds"]:
        x["lessons"] = []
    gain["seeds"][0]["gate"] = ["step 1: library gate: ...: adopted, better beyond noise", "step 2: ...: rejected, x"]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in bench.glance([gain, harm, flat, empty]).splitlines()}
    assert rows["ranges"].endswith("| gain |") and "| 1/2 / off / off |" in rows["ranges"]
    assert rows["percent"].endswith("| HARM |")  # the point estimate below -0.02
    assert rows["arithmetic (held back)"].endswith("| no harm, no clear gain |")  # its CI holds 0
    assert rows["units"].endswith("| no lesson kept (no harm) |") and "| 0 / 0 / 0 |" in rows["units"]
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
    before, _ = bench.parse(["--out", str(tmp_path), "--trial-order", "plan"])  # as results were kept before
    added = {"gate_temperature", "trial_order"}  # at the values they had before they were settings
    key = json.dumps({k: getattr(before, k) for k in bench.RESULT_SETTINGS if k not in added}, sort_keys=True)
    assert bench.results_dir(before).name == bench.hashlib.sha256(key.encode()).hexdigest()[:12]  # as it was
    cooler, _ = bench.parse(["--out", str(tmp_path), "--trial-order", "plan", "--gate-temperature", "0.3"])
    assert bench.results_dir(cooler) != bench.results_dir(before)
    assert bench.gate_section(cooler) == {"enabled": "auto", "temperature": 0.3}
    supported, _ = bench.parse(["--out", str(tmp_path)])  # the product's order now: support
    assert bench.results_dir(supported) != bench.results_dir(before)


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
