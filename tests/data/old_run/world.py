"""The old run's config and scripted world, shared by the script that wrote the fixture (``make.py``) and the
test that resumes it (``tests/test_old_database.py``): the same config gives the same fingerprint."""

from __future__ import annotations

from clgrpo.testing.fake_openai import ChatRequest, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, LibraryGate, ModelConfig, RunConfig

PROBLEMS = make_problems(n_per_family=2, seed=5)
FIRST_STEP, SECOND_STEP = PROBLEMS[: len(PROBLEMS) // 2], PROBLEMS[len(PROBLEMS) // 2 :]


def config(base_url: str) -> RunConfig:
    """Paths relative to the folder the run works in (the fixture's, or a test's copy of it)."""
    model = ModelConfig(
        model="scripted",
        base_url=base_url,
        api_key_env=None,
        max_tokens=256,
        max_retries=0,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    return RunConfig(
        run_id="old-run",
        db_path="old_run.duckdb",
        dataset=DatasetConfig(path="train.jsonl", shuffle=False),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=1, batch_size=len(FIRST_STEP), rollout_chunk_size=5),
        learning=LearningConfig(
            consolidate_chunk_size=3, summarize_chunk_size=4, library_gate=LibraryGate(enabled=False)
        ),
        concurrency=8,
    )


class Refusing(ScriptedWorld):
    """The scripted world, refusing the policy's calls about the given problems; ``asked``: the problems the
    policy was asked about."""

    def __init__(self, down: list[dict], **kwargs) -> None:
        super().__init__(**kwargs)
        self.down = {p["problem"] for p in down}
        self.asked: set[str] = set()

    def __call__(self, request: ChatRequest):
        if role_of(request) == "policy":
            self.asked |= {p["problem"] for p in PROBLEMS if p["problem"] in request.messages[-1]["content"]}
        if any(problem in request.messages[-1]["content"] for problem in self.down):
            raise ValueError("the policy is down for this problem")
        return super().__call__(request)


def world(down: list[dict]) -> Refusing:
    return Refusing(down, seed=11)
