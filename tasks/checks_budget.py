"""What a step's checks may spend (``learning.checks_budget``).

A step's own work is its rollouts and its learner calls; its checks are the lesson trials (with the calls that
shorten and cluster the candidates) and the library gate. Together the checks spend at most ``checks_budget``
times the step's own tokens, so a step with its checks costs at most 1 + ``checks_budget`` times the same step
without them, whatever the candidates or the gate's looks.

The gate measures the whole step, so its samples are reserved first: every look's samples not already drawn,
at the tokens of one of the step's rollouts (prompt and reply) times ``RESERVE_MARGIN`` (a library in the prompt
makes a gate sample longer than a rollout). Trials spend what is left, candidate by candidate in the plan's
order: one whose samples do not fit is rejected untried, saying so. The gate always draws its first look and
draws a further look only if its samples fit what is left (at the tokens its own samples took so far); else it
decides at the look it has, saying so. The reserve is the gate's own: a trial costs what its samples turn out
to cost, so the trials may overrun their share by part of their last trial, and that overrun takes no look from
the gate (a look fits what is left of the budget or of the reserve, whichever is more). The checks then exceed
the budget by at most that overrun.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clgrpo.words import counted
from schemas.records import LLMCall

RESERVE_MARGIN = 1.25


def tokens(calls: Sequence[LLMCall]) -> int:
    return sum(c.tokens_in + c.tokens_out for c in calls)


@dataclass(frozen=True)
class ChecksBudget:
    """The tokens a step's checks may spend (``allowed``, None: no limit), what one policy sample is expected to
    cost (``per_sample``: the step's rollouts' tokens per rollout), the part kept for the gate
    (``gate_reserve``), what the checks spent before the current stage (``spent``) and, for the gate, the
    reserve it may spend whatever the trials overran (``gate_floor``)."""

    ratio: float | None
    allowed: int | None
    per_sample: float
    gate_reserve: int = 0
    spent: int = 0
    gate_floor: int = 0

    @classmethod
    def of(
        cls, ratio: float | None, own_tokens: int, rollout_tokens: int, rollouts: int, gate_samples: int = 0
    ) -> ChecksBudget:
        """``gate_samples``: the samples the gate would draw at all its looks (0: no gate this step)."""
        per_sample = rollout_tokens / rollouts if rollouts else 0.0
        allowed = None if ratio is None else int(ratio * own_tokens)
        return cls(ratio, allowed, per_sample, math.ceil(gate_samples * per_sample * RESERVE_MARGIN))

    def left(self, spent_here: int = 0, *, reserve: bool = True) -> float:
        """Tokens still free for the current stage after ``spent_here`` (trials: the gate's reserve kept)."""
        if self.allowed is None:
            return math.inf
        free = self.allowed - self.spent - spent_here - (self.gate_reserve if reserve else 0)
        return max(free, self.gate_floor - spent_here) if self.gate_floor else free

    def fits(self, samples: int, per_sample: float, spent_here: int = 0, *, reserve: bool = True) -> bool:
        return samples * per_sample <= self.left(spent_here, reserve=reserve)

    def for_gate(self, spent_by_trials: int) -> ChecksBudget:
        """What the gate may spend once the trials (and the calls around them) spent ``spent_by_trials``: what
        is left of the budget, and its reserve at least."""
        return replace(self, gate_reserve=0, gate_floor=self.gate_reserve, spent=self.spent + spent_by_trials)

    def after(self, spent: int) -> ChecksBudget:
        return replace(self, spent=self.spent + spent)

    def describe(self, spent_here: int = 0, *, reserve: bool = True) -> str:
        """The budget and what is left of it, for a reason."""
        left = max(0, int(self.left(spent_here, reserve=reserve)))
        kept = f", {self.gate_reserve:,} of them kept for the library gate" if reserve and self.gate_reserve else ""
        return (
            f"the step's checks budget (learning.checks_budget={self.ratio:g}: {self.allowed or 0:,} tokens{kept}) "
            f"has {counted(left, 'token')} left"
        )
