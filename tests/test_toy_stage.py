"""Adding a stage to the training step is its module, its record, its entry in a step table (``flows/step.py``'s
``STEP`` for a stage of ours; from outside, a table passed to the ``Trainer``) and its test, nothing else: this
module is the toy stage's module and its test. It asks the learner's opinion of each
step's accuracy (one call) and stores it in a table of its own (``toy_opinions``: its record and one declaration,
``schemas.tables``) beside the call (``llm_calls``); it declares its typed output and its place after verify; it is
stored, read back, visible to the later stages through the step state, fails the run when its call fails, and a
rerun redoes it without redoing what the step stored before it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prefect import flow

from clgrpo.llm import shared_client
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld
from flows.step import STEP, StepStage
from flows.train import Trainer
from schemas.config import RunConfig
from schemas.records import LLMCall, Record
from schemas.stages import Stage
from schemas.tables import TABLES, Table, declare
from tasks.integrity import StageFailedError
from tasks.outputs import StageOutput, Verified
from tests.test_pipeline import make_config

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]

TOY = "toy_opinion"  # its name in the store: no member of the Stage enum needed


class ToyOpinion(Record):  # the record of its own table
    correct: int
    attempts: int
    opinion: str


@dataclass
class Opinion(StageOutput):  # the typed output: its fields are the tables it writes
    toy_opinions: list[ToyOpinion] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@pytest.fixture
def toy_table():
    """The table, declared as the stage's module would declare it when imported (here: for this test only)."""
    yield declare(Table("toy_opinions", ToyOpinion))
    TABLES.pop("toy_opinions")


async def compute_opinion(context, s) -> Opinion:  # the step's context and state: the flow is not passed
    rewards = s.get(Verified).rewards
    correct = sum(r.reward > 0 for r in rewards)
    ask = f"Step {s.step}: {correct} of {len(rewards)} attempts were right. Good or bad?"
    reply = await shared_client(s.cfg).complete([{"role": "user", "content": ask}], stage=TOY)
    return Opinion([ToyOpinion(correct=correct, attempts=len(rewards), opinion=reply.text)], reply.calls)


SEEN: list[tuple[int, int]] = []


def remember(context, s) -> None:  # the later stages see its output through the step state
    SEEN.append((s.step, len(s.get(Opinion).llm_calls)))


# its items cannot fail one by one (no failure rule): a call that fails after its retries fails the stage
TOY_STAGE = StepStage(TOY, compute_opinion, Opinion, after=remember)
AFTER_VERIFY = [spec.stage for spec in STEP].index(Stage.VERIFY) + 1
TOY_STEP = (*STEP[:AFTER_VERIFY], TOY_STAGE, *STEP[AFTER_VERIFY:])  # the step with the toy stage after verify


@flow(name="train-with-opinions")
async def train_with_opinions(cfg: RunConfig) -> None:
    """A training run whose step is ``TOY_STEP``."""
    with Store(cfg.db_path) as store:
        await Trainer(cfg, store, stages=TOY_STEP).run()


class Moody(ScriptedWorld):
    """The scripted world, whose opinion server is down for step 2 while ``down``."""

    down = True

    def __call__(self, request):
        if self.down and request.messages[-1]["content"].startswith("Step 2:"):
            raise ValueError("the opinion server is down")
        return super().__call__(request)


async def test_a_toy_stage_is_one_step_entry(tmp_path, toy_table):
    SEEN.clear()
    world = Moody(seed=7)
    with FakeOpenAIServer(world) as server:
        cfg = make_config(server, tmp_path, "toy", pipeline=True)
        cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"max_retries": 1})})
        with pytest.raises(StageFailedError, match=f"step 2 {TOY}: a learner call failed after its retries"):
            await train_with_opinions(cfg)
        assert SEEN == [(1, 1)]  # stored at step 1, then failed at step 2: the run stopped there
        policy = server.stats.by_role["policy"]
        world.down = False
        await train_with_opinions(cfg)  # the rerun: step 2's rollouts and rewards are read back, the toy stage redone
        assert SEEN == [(1, 1), (2, 3)]  # the state holds what was stored: the opinion and the 2 failed attempts
        assert server.stats.by_role["policy"] - policy == 1  # no rollout again: only step 2's opinion
    with Store(cfg.db_path, read_only=True) as store:
        stages = store.query("SELECT step, stage, n_rows FROM stage_runs WHERE stage = ? ORDER BY step", [TOY])
        assert store.runs().set_index("run_id").loc["toy", "status"] == "completed"
        opinions = [store.read_stage(Opinion, "toy", step, TOY).toy_opinions for step in (1, 2)]
    # its own table: one opinion per step, read back as it was stored
    assert [len(o) for o in opinions] == [1, 1] and all(o[0].attempts > 0 and o[0].opinion for o in opinions)
    # step 2 stored its opinion, its call and the two failed attempts of the first run: every request is accounted
    assert stages.to_dict(orient="records") == [
        {"step": 1, "stage": TOY, "n_rows": 2},
        {"step": 2, "stage": TOY, "n_rows": 4},
    ]
