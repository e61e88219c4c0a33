"""A training step's rollout and verify stages written ahead into a run's database, as the stage protocol reads
them back: a flow with a policy too weak to be ever right (the tiny random model) then learns from groups with
variance. The rollouts carry the prompt hash the rollout stage would give (empty library, direct mode)."""

from __future__ import annotations

import json

from clgrpo.storage.store import Store
from domains import get_domain
from flows.train import plan_steps
from schemas.config import RunConfig
from schemas.records import Reward, Rollout, Turn, text_hash
from tasks.verify import compute_group_advantages

RIGHT = (True, True, False, False)  # per sample of a group: answered right


def seed_first_step(cfg: RunConfig) -> list[Rollout]:
    """Step 1's rollouts (two right, two wrong answers per problem), rewards and group advantages."""
    domain = get_domain(cfg.domain)
    problems, _ = domain.load_dataset(cfg.dataset)
    first = plan_steps(problems, epochs=1, batch_size=cfg.grpo.batch_size, seed=cfg.seed)[0].problems
    rollouts, rewards = [], []
    for problem in first:
        messages = domain.rollout_messages(problem, "")
        prompt_hash = text_hash(json.dumps([messages, None], sort_keys=True))
        for i in range(cfg.grpo.group_size):
            right = RIGHT[i % len(RIGHT)]
            text = f"So the answer is \\boxed{{{problem.answer}}}" if right else "maybe lesson system user"
            rollouts.append(
                Rollout(
                    problem_id=problem.problem_id,
                    sample_idx=i,
                    prompt_hash=prompt_hash,
                    library_version=0,
                    finish_reason="stop",
                    turns=[Turn(kind="assistant", content=text)],
                )
            )
            rewards.append(
                Reward(
                    problem_id=problem.problem_id,
                    sample_idx=i,
                    reward=1.0 if right else 0.0,
                    reward_source="ground_truth",
                )
            )
    advantages = compute_group_advantages(first, rollouts, rewards, use_groundtruth=True)
    with Store(cfg.db_path) as store:
        store.register_run(cfg)
        store.write_stage(cfg.run_id, 1, "rollout", {"rollouts": rollouts, "llm_calls": []})
        store.write_stage(
            cfg.run_id, 1, "verify", {"rewards": rewards, "group_advantages": advantages, "llm_calls": []}
        )
    return rollouts
