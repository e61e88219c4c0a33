"""One measurement (``tasks.measure``): a sample is keyed by what determines it and drawn once.

The unit tests pin what enters a draw key; the flow tests run ``clgrpo eval`` against the scripted world over
HTTP and count the policy's requests: a condition measured before is read back, anything that changes what is
drawn (the temperature, the prompt template) draws again.
"""

import threading

import pytest
import yaml

from application.cli import main
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, role_of
from clgrpo.testing.scripted_llm import FAMILIES, ScriptedWorld, make_problems, write_jsonl
from domains import domain_for
from schemas.config import AgentConfig, DatasetConfig, ModelConfig, RolloutPlacement, RunConfig
from schemas.records import Problem, Sample
from tasks.measure import Sampling, draw_keys, reusable, sample_seeds

PROBLEMS = [Problem(problem_id=f"p{i}", problem=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(3)]


def config(**policy) -> RunConfig:
    return RunConfig(
        dataset=DatasetConfig(path="unused.jsonl"),
        policy=ModelConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=None, **policy),
    )


def keys(cfg: RunConfig, temperature: float = 0.3, library: ExperienceLibrary | None = None, seed: int = 0) -> dict:
    return draw_keys(
        PROBLEMS,
        library or ExperienceLibrary(),
        2,
        sample_seeds(PROBLEMS, seed),
        Sampling.of(cfg, temperature),
        domain_for(cfg),
    )


def test_a_draw_key_changes_with_what_determines_the_sample_and_only_with_that():
    base = keys(config())
    assert len(set(base.values())) == len(PROBLEMS) * 2  # every problem and sample index its own draw
    # how the policy is reached is not what it answers: another port, timeout or request batching draws the same
    same = config(timeout_s=999, max_retries=9, supports_n=False).model_copy(
        update={"policy": config().policy.model_copy(update={"base_url": "http://127.0.0.1:10/v1"})}
    )
    assert keys(same) == base
    # anything that shapes the answer draws anew
    lesson = ExperienceLibrary.from_mapping({"G0": "Add the two numbers, then check the sum."})
    changed = {
        "temperature": keys(config(), temperature=0.7),
        "model": keys(config().model_copy(update={"policy": config().policy.model_copy(update={"model": "n"})})),
        "max_tokens": keys(config(max_tokens=99)),
        "library": keys(config(), library=lesson),
        "seed": keys(config(), seed=1),
        "agent": keys(config().model_copy(update={"rollout": RolloutPlacement(mode="agent", agent=AgentConfig())})),
    }
    for what, other in changed.items():
        assert not set(other.values()) & set(base.values()), what


def test_the_prompt_template_is_in_the_key(monkeypatch):
    import domains.math as math_domain

    base = keys(config())
    original = math_domain.rollout_messages
    monkeypatch.setattr(
        math_domain,
        "rollout_messages",
        lambda problem, library_text, *shown: [
            *original(problem, library_text, *shown)[:-1],
            {"role": "user", "content": "Q?"},
        ],
    )
    assert not set(keys(config()).values()) & set(base.values())


def test_only_keyed_samples_without_an_error_are_reused():
    def sample(key: str | None, **extra) -> Sample:
        return Sample(problem_id="p", sample_idx=0, seed=1, reward=1.0, draw_key=key, **extra)

    found = reusable([sample("a"), sample("a", final_text="later"), sample(None), sample("b", error="timeout")])
    assert list(found) == ["a"] and found["a"].final_text == ""  # the first of a key; no key or an error: never
    # ungraded without an error (no ground truth): a valid draw all the same
    assert list(reusable([Sample(problem_id="p", sample_idx=0, seed=1, reward=None, draw_key="c")])) == ["c"]


# --- drawn once, from the command line ------------------------------------------------------------------------
class CountingWorld(ScriptedWorld):
    """Counts the policy's requests and the samples they ask for."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.requests = self.samples = 0
        self._lock = threading.Lock()

    def __call__(self, request: ChatRequest) -> list[str]:
        if role_of(request) == "policy":
            with self._lock:
                self.requests += 1
                self.samples += request.n or 1
        return super().__call__(request)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_eval_draws_only_what_no_earlier_measurement_drew(tmp_path, monkeypatch, capsys):
    dataset = write_jsonl(make_problems(n_per_family=2, seed=4), tmp_path / "test.jsonl")  # 8 problems
    library = tmp_path / "lessons.json"
    ExperienceLibrary.from_mapping({f"G{i}": f.lesson for i, f in enumerate(FAMILIES)}).dump(library)
    world = CountingWorld(seed=3)
    with FakeOpenAIServer(world) as server:
        run = config().model_copy(
            update={"policy": config().policy.model_copy(update={"base_url": server.base_url, "model": "scripted"})}
        )
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(yaml.safe_dump(run.model_dump(mode="json", exclude_none=True)))
        db = str(tmp_path / "eval.duckdb")

        def evaluate(*refs: str, extra: tuple[str, ...] = ()) -> int:
            before = world.samples
            args = ["eval", "--dataset", str(dataset), "--k", "3", "--bootstrap", "200", "--config", str(cfg)]
            for i, ref in enumerate(refs):
                args += ["--library" if i == 0 else "--compare", ref]
            assert main([*args, "--db", db, *extra]) == 0, capsys.readouterr().err
            return world.samples - before

        assert evaluate("none") == 8 * 3
        assert evaluate("none", str(library)) == 8 * 3  # none is read back: only the library's samples
        assert evaluate(str(library), "none") == 0  # both measured: nothing drawn, another evaluation all the same
        assert evaluate("none", extra=("--temperature", "0.6")) == 8 * 3  # another temperature draws again
        import domains.math as math_domain

        original = math_domain.rollout_messages
        monkeypatch.setattr(
            math_domain,
            "rollout_messages",
            lambda p, text, *shown: [{"role": "system", "content": "Be brief."}, *original(p, text, *shown)],
        )
        assert evaluate("none") == 8 * 3  # another prompt template draws again

    with Store(db, read_only=True) as store:
        rows = store.query("SELECT run_id, condition, drawn, tokens_out FROM eval_results")
    assert rows["drawn"].sum() == 4 * 8 * 3 and (~rows["drawn"]).sum() == 3 * 8 * 3


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_eval_says_at_its_start_what_it_reads_and_fresh_draws_everything_anew(tmp_path, capsys):
    from clgrpo.process import progress
    from schemas.stages import Stage

    dataset = write_jsonl(make_problems(n_per_family=2, seed=4), tmp_path / "test.jsonl")  # 8 problems
    library = tmp_path / "lessons.json"
    ExperienceLibrary.from_mapping({f"G{i}": f.lesson for i, f in enumerate(FAMILIES)}).dump(library)
    world = CountingWorld(seed=3)
    seen: list[progress.StageProgress] = []

    def listen(p: progress.StageProgress) -> None:
        if p.stage == Stage.EVALUATE and not p.finished:
            seen.append(p)

    with FakeOpenAIServer(world) as server:
        run = config().model_copy(
            update={"policy": config().policy.model_copy(update={"base_url": server.base_url, "model": "scripted"})}
        )
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(yaml.safe_dump(run.model_dump(mode="json", exclude_none=True)))
        db = str(tmp_path / "eval.duckdb")

        def evaluate(*refs: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
            before = world.samples
            args = ["eval", "--dataset", str(dataset), "--k", "3", "--bootstrap", "200", "--config", str(cfg)]
            for i, ref in enumerate(refs):
                args += ["--library" if i == 0 else "--compare", ref]
            assert main([*args, "--db", db, *extra]) == 0, capsys.readouterr().err
            return world.samples - before, capsys.readouterr().out

        assert evaluate("none")[0] == 8 * 3
        progress.add_listener(listen)
        try:
            assert evaluate("none", str(library))[0] == 8 * 3
        finally:
            progress.remove_listener(listen)
        # the stored ones are counted when the evaluation starts, not when their condition comes
        assert seen[0].total == 2 * 8 * 3 and seen[0].unit == "samples (24 read, 24 to draw)"
        assert seen[1].done == 8 * 3 and all(p.done >= 8 * 3 for p in seen[1:])

        drawn, out = evaluate("none", extra=("--fresh",))
        assert drawn == 8 * 3  # whatever is stored, drawn anew
        fresh_id = out.split("run_id = ")[1].split(")")[0]
        assert fresh_id.endswith("-2")
        drawn, out = evaluate("none")  # later: the latest draw is read back
        assert drawn == 0 and f"run_id = {fresh_id})" in out and "read back: 24 drawn " in out
    with Store(db, read_only=True) as store:
        rows = store.query("SELECT run_id, drawn FROM eval_results WHERE condition = 'none'")
    assert len(rows) == 3 * 8 * 3 and rows["drawn"].sum() == 2 * 8 * 3  # the first draw kept beside the fresh one
