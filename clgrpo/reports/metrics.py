"""Evaluation metrics with their uncertainty: Mean@k, Pass@k, bootstrap confidence intervals.

Rewards come as a matrix ``(n_problems, n_samples)``: one row per problem, one column per sample, the same
column order (sample seeds) for every condition. A sample is *correct* when its reward is full credit
(>= ``CORRECT_AT``).

Confidence intervals are bias-corrected and accelerated (BCa) bootstraps over problems (problems are the unit
that varies between benchmarks); ``resample_samples=True`` also resamples the samples inside each drawn
problem for Mean@k (a two-level bootstrap, wider; Pass@k always resamples problems only, since duplicated
samples would bias it down). A paired difference resamples the same problems (and sample columns) for both
conditions, so whatever the two conditions share cancels out. Replicates come from a seeded numpy Generator.

Two arms measured on the same problems and seeds (a lesson trial, the library gate) are compared pair by pair:
``paired_rewards`` (the (problem, sample) pairs graded in both), the exact one-sided ``sign_test`` over the pairs
that differ, and ``compare`` (the means, the difference's paired-bootstrap CI over problems, the sign test).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from schemas.records import Sample

Metric = Literal["mean_at_k", "pass_at_k"]
CORRECT_AT = 1.0 - 1e-9
_MAX_BLOCK_CELLS = 4_000_000  # bootstrap replicates are drawn in blocks of at most this many rewards


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float
    level: float = 0.95

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    @property
    def excludes_zero(self) -> bool:
        return not self.contains(0.0)

    def format(self, digits: int = 3, signed: bool = False) -> str:
        sign = "+" if signed else ""
        return f"{self.value:{sign}.{digits}f} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


def as_matrix(rewards: ArrayLike) -> NDArray[np.float64]:
    matrix = np.asarray(rewards, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"rewards must be a non-empty (problems, samples) matrix, got shape {matrix.shape}")
    return matrix


def mean_at_k(rewards: ArrayLike) -> float:
    """Average reward over all problems and samples (every problem has the same number of samples)."""
    return float(as_matrix(rewards).mean())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that k of a problem's samples contain a correct one, from n samples
    of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _pass_table(n: int, k: int) -> NDArray[np.float64]:
    """pass@k for every possible number of correct samples 0..n."""
    return np.array([pass_at_k(n, c, k) for c in range(n + 1)])


def per_problem(rewards: ArrayLike, metric: Metric, k: int | None = None) -> NDArray[np.float64]:
    """The metric of each problem (row): its mean reward, or its pass@k."""
    matrix = as_matrix(rewards)
    if metric == "mean_at_k":
        return matrix.mean(axis=1)
    n = matrix.shape[1]
    correct = (matrix >= CORRECT_AT).sum(axis=1)
    return _pass_table(n, k or n)[correct]


def metric_value(rewards: ArrayLike, metric: Metric, k: int | None = None) -> float:
    return float(per_problem(rewards, metric, k).mean())


def _replicates(
    matrices: list[NDArray[np.float64]],
    metric: Metric,
    k: int | None,
    n_boot: int,
    rng: np.random.Generator,
    resample_samples: bool,
) -> list[NDArray[np.float64]]:
    """Bootstrap replicates of the metric for each matrix, all drawn with the same indices (paired)."""
    n_problems, n_samples = matrices[0].shape
    if not resample_samples or metric == "pass_at_k":  # resampled duplicates would bias Pass@k down
        rows = [per_problem(m, metric, k) for m in matrices]
        idx = rng.integers(0, n_problems, size=(n_boot, n_problems))
        return [r[idx].mean(axis=1) for r in rows]
    block = max(1, _MAX_BLOCK_CELLS // (n_problems * n_samples))
    out: list[list[NDArray[np.float64]]] = [[] for _ in matrices]
    for start in range(0, n_boot, block):
        size = min(block, n_boot - start)
        p_idx = rng.integers(0, n_problems, size=(size, n_problems, 1))
        s_idx = rng.integers(0, n_samples, size=(size, n_problems, n_samples))
        for i, m in enumerate(matrices):
            drawn = m[p_idx, s_idx].reshape(size * n_problems, n_samples)
            out[i].append(per_problem(drawn, metric, k).reshape(size, n_problems).mean(axis=1))
    return [np.concatenate(parts) for parts in out]


def _bca_interval(
    value: float, replicates: NDArray[np.float64], per_problem_values: NDArray[np.float64], level: float
) -> Estimate:
    """Bias-corrected and accelerated percentile interval (Efron): the bias correction comes from where the
    point estimate falls among the replicates, the acceleration from a jackknife over problems. Better than
    plain percentiles for skewed metrics such as Pass@k near 1."""
    normal, n_boot = NormalDist(), len(replicates)
    below = (np.sum(replicates < value) + 0.5 * np.sum(replicates == value)) / n_boot
    z0 = normal.inv_cdf(min(max(below, 0.5 / n_boot), 1 - 0.5 / n_boot))
    n = len(per_problem_values)
    jackknife = (per_problem_values.sum() - per_problem_values) / max(n - 1, 1)
    d = jackknife.mean() - jackknife
    denominator = 6.0 * float(np.sum(d**2)) ** 1.5
    accel = float(np.sum(d**3)) / denominator if denominator > 0 else 0.0
    quantiles = []
    for z in (normal.inv_cdf((1 - level) / 2), normal.inv_cdf((1 + level) / 2)):
        adjusted = z0 + (z0 + z) / (1 - accel * (z0 + z))
        quantiles.append(normal.cdf(adjusted))
    low, high = np.quantile(replicates, quantiles)
    # widened to hold the point estimate (a discrete replicate distribution can leave it just outside)
    return Estimate(value=value, low=float(min(low, value)), high=float(max(high, value)), level=level)


def bootstrap_ci(
    rewards: ArrayLike,
    metric: Metric = "mean_at_k",
    *,
    k: int | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    resample_samples: bool = False,
) -> Estimate:
    """The metric with its percentile-bootstrap confidence interval over problems (and samples)."""
    matrix = as_matrix(rewards)
    rng = np.random.default_rng(seed)
    (boot,) = _replicates([matrix], metric, k, n_boot, rng, resample_samples)
    values = per_problem(matrix, metric, k)
    return _bca_interval(float(values.mean()), boot, values, level)


def paired_difference(
    baseline: ArrayLike,
    candidate: ArrayLike,
    metric: Metric = "mean_at_k",
    *,
    k: int | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    resample_samples: bool = False,
) -> Estimate:
    """candidate - baseline on the same problems (rows) and sample seeds (columns), with a bootstrap CI that
    resamples problems (and sample columns) jointly for both conditions."""
    a, b = as_matrix(baseline), as_matrix(candidate)
    if a.shape != b.shape:
        raise ValueError(f"a paired comparison needs the same problems and samples: shapes {a.shape} vs {b.shape}")
    rng = np.random.default_rng(seed)
    boot_a, boot_b = _replicates([a, b], metric, k, n_boot, rng, resample_samples)
    differences = per_problem(b, metric, k) - per_problem(a, metric, k)
    return _bca_interval(float(differences.mean()), boot_b - boot_a, differences, level)


# --- two arms, pair by pair ------------------------------------------------------------------------------------
def paired_rewards(
    before: Sequence[Sample], after: Sequence[Sample], problem_ids: Collection[str] | None = None
) -> list[tuple[float, float]]:
    """(reward before, reward after) of each (problem, sample index) graded in both arms, in the order of
    ``after``; only ``problem_ids``' when given."""
    reward_before = {(s.problem_id, s.sample_idx): s.reward for s in before}
    pairs = []
    for s in after:
        b = reward_before.get((s.problem_id, s.sample_idx))
        if (problem_ids is None or s.problem_id in problem_ids) and s.reward is not None and b is not None:
            pairs.append((b, s.reward))
    return pairs


def sign_test(better: int, worse: int) -> tuple[float, float]:
    """Exact one-sided binomial tails over the pairs that differ: P(at least ``better`` better) and P(at least
    ``worse`` worse) if neither arm were better."""
    n = better + worse
    if n == 0:
        return 1.0, 1.0

    def tail(at_least: int) -> float:
        return sum(math.comb(n, i) for i in range(at_least, n + 1)) / 2**n

    return tail(better), tail(worse)


@dataclass(frozen=True)
class Comparison:
    problems: int
    pairs: int
    mean_before: float | None
    mean_after: float | None
    diff: float | None
    ci_low: float | None
    ci_high: float | None
    better: int
    worse: int
    p_better: float
    p_worse: float


def compare(problem_ids: Sequence[str], before: Sequence[Sample], after: Sequence[Sample], k: int) -> Comparison:
    """The paired comparison over ``problem_ids``: means over pairs graded in both arms, the difference's CI by a
    paired bootstrap over problems (those whose every pair was graded), and the sign test."""
    pairs = paired_rewards(before, after, set(problem_ids))
    better = sum(a > b for b, a in pairs)
    worse = sum(a < b for b, a in pairs)
    p_better, p_worse = sign_test(better, worse)
    if not pairs:
        return Comparison(len(problem_ids), 0, None, None, None, None, None, 0, 0, 1.0, 1.0)
    mean_b = float(np.mean([b for b, _ in pairs]))
    mean_a = float(np.mean([a for _, a in pairs]))
    low, high = _paired_ci(problem_ids, before, after, k)
    return Comparison(
        len(problem_ids), len(pairs), mean_b, mean_a, mean_a - mean_b, low, high, better, worse, p_better, p_worse
    )


def _paired_ci(
    problem_ids: Sequence[str], before: Sequence[Sample], after: Sequence[Sample], k: int
) -> tuple[float | None, float | None]:
    """The 95% CI of after - before by a paired bootstrap over the problems whose k pairs were all graded (None
    with fewer than two such problems)."""
    reward_before = {(s.problem_id, s.sample_idx): s.reward for s in before}
    reward_after = {(s.problem_id, s.sample_idx): s.reward for s in after}
    rows_b, rows_a = [], []
    for pid in problem_ids:
        b = [reward_before.get((pid, i)) for i in range(k)]
        a = [reward_after.get((pid, i)) for i in range(k)]
        if all(x is not None for x in b + a):
            rows_b.append(b)
            rows_a.append(a)
    if len(rows_b) < 2:
        return None, None
    estimate = paired_difference(np.array(rows_b, dtype=float), np.array(rows_a, dtype=float), seed=0)
    return estimate.low, estimate.high
