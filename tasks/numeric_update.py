"""Stage (hybrid learning): a numeric GRPO step on the step's stored trajectories (``clgrpo.models.hybrid``).

Inputs are what verify stored: each usable rollout with its group advantage (zero-advantage and ungraded
completions carry no gradient and are skipped), its prompt rebuilt as the rollout built it and checked against
the rollout's ``prompt_hash``. Output: one ``AdapterVersion`` row (table ``adapters``) and the adapter folder
``<export dir>/adapter_step<N>/``, continuing from the previous step's adapter. The folder is written under a
temporary name and renamed, so a killed stage leaves no adapter and no row; the stage protocol reads a stored
one back instead of training again.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm.adapters import adapter_dir, model_identity, write_meta
from clgrpo.models.weights import resolve_model_path
from domains import domain_for
from schemas.config import RunConfig
from schemas.records import AdapterVersion, GroupAdvantage, LibraryVersion, NumericItem, Problem, Rollout, text_hash
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.rollout import policy_messages


@dataclass
class NumericInputs:
    items: list[NumericItem]
    skipped: int  # usable-looking rollouts left out: zero or no advantage, failed, prompt not reproducible, cap


def numeric_inputs(
    config: RunConfig,
    problems: list[Problem],
    rollouts: list[Rollout],
    advantages: list[GroupAdvantage],
    library: LibraryVersion,
) -> NumericInputs:
    """The completions to learn from, in problem order then sample order, at most ``hybrid.max_rows``."""
    domain = domain_for(config)
    shown = ExperienceLibrary.from_version(library)
    by_problem = {a.problem_id: a for a in advantages}
    rollouts_of: dict[str, list[Rollout]] = {}
    for r in rollouts:
        rollouts_of.setdefault(r.problem_id, []).append(r)
    items, skipped = [], 0
    for problem in problems:
        group = rollouts_of.get(problem.problem_id, [])
        advantage = by_problem.get(problem.problem_id)
        messages = policy_messages(problem, shown, domain)
        prompt_hash = text_hash(json.dumps([messages, None], sort_keys=True))  # as tasks.rollout (direct mode)
        for r in sorted(group, key=lambda r: r.sample_idx):
            value = sample_advantage(advantage, group, r)
            if value is None or value == 0.0 or r.error is not None or r.prompt_hash != prompt_hash:
                skipped += 1
                continue
            items.append(
                NumericItem(
                    problem_id=r.problem_id,
                    sample_idx=r.sample_idx,
                    messages=messages,
                    completion=r.final_text,
                    truncated=r.truncated,
                    advantage=value,
                )
            )
    cap = config.hybrid.max_rows
    return NumericInputs(items[:cap], skipped + max(0, len(items) - cap))


def sample_advantage(advantage: GroupAdvantage | None, group: list[Rollout], rollout: Rollout) -> float | None:
    """The stored advantage of ``rollout``: the group's advantages are in sample order (``verify``)."""
    if advantage is None:
        return None
    order = sorted(r.sample_idx for r in group)
    position = order.index(rollout.sample_idx)
    return advantage.advantages[position] if position < len(advantage.advantages) else None


def train_step(
    config: RunConfig,
    step: int,
    items: list[NumericItem],
    skipped: int,
    parent: str | None,
    library_version: int,
    target: Path,
) -> AdapterVersion:
    """Load the policy with ``parent``'s adapter (or a fresh one), train on ``items``, save to ``target``."""
    from clgrpo.models import hybrid

    location = resolve_model_path(config.policy.model_path or config.policy.model)
    device = hybrid.training_device(config.policy.device)
    model, tokenizer = hybrid.load_trainable(location, device, config.hybrid, parent)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outcome = hybrid.train_adapter(model, hybrid.examples_from(items, tokenizer), config.hybrid, pad_id or 0)
    base = model_identity(location)
    partial = target.with_name(f"{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    hybrid.save_adapter(model, partial)
    write_meta(partial, base, step, config.run_id or "")
    shutil.rmtree(target, ignore_errors=True)  # a killed attempt's folder (its stage has no row): replaced
    partial.rename(target)
    return AdapterVersion(
        base_model=base,
        rank=config.hybrid.rank,
        rows_used=outcome.rows_used,
        rows_skipped=skipped + len(items) - outcome.rows_used,
        loss_before=outcome.loss_before,
        loss_after=outcome.loss_after,
        logprob_change_pos=outcome.logprob_change_pos,
        logprob_change_neg=outcome.logprob_change_neg,
        library_version=library_version,
        parent_path=parent,
        path=str(target),
        device=outcome.device,
        seconds=outcome.seconds,
    )


@stage_task(Stage.NUMERIC_UPDATE, run_name="numeric-update-step{step}")
async def numeric_update_task(
    config: RunConfig,
    step: int,
    items: list[NumericItem],
    skipped: int,
    parent: str | None,
    library_version: int,
    export: str,
) -> AdapterVersion:
    """The numeric step in a worker thread (the event loop keeps serving Prefect and the other stages)."""
    return await asyncio.to_thread(
        train_step, config, step, items, skipped, parent, library_version, adapter_dir(Path(export), step)
    )
