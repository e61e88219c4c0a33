"""Mean@k / Pass@k and their bootstrap confidence intervals."""

import itertools
import math

import numpy as np
import pytest

from clgrpo.reports.metrics import bootstrap_ci, mean_at_k, paired_difference, pass_at_k, per_problem


def brute_force_pass_at_k(outcomes: list[int], k: int) -> float:
    """Fraction of all k-subsets of the samples that contain a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_mean_at_k_and_pass_at_k_on_small_cases():
    rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert mean_at_k(rewards) == pytest.approx(5 / 12)
    assert per_problem(rewards, "pass_at_k").tolist() == [1.0, 1.0, 0.0]  # k = n: any correct sample
    assert per_problem(rewards, "pass_at_k", k=1).tolist() == [0.25, 1.0, 0.0]  # pass@1 = mean
    assert per_problem(rewards, "pass_at_k", k=2).tolist() == pytest.approx([0.5, 1.0, 0.0])
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 2, 3) == pytest.approx(1 - math.comb(8, 3) / math.comb(10, 3))
    assert per_problem([[0.5, 1.0]], "pass_at_k").tolist() == [1.0]  # partial credit is not a pass
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="non-empty"):
        mean_at_k([])


@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_unbiased_pass_at_k_equals_the_brute_force_average_over_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k)), (n, c, k)


def test_unbiased_pass_at_k_is_unbiased_in_simulation():
    rng = np.random.default_rng(3)
    p, n, k = 0.15, 10, 4
    estimates = [pass_at_k(n, int((rng.random(n) < p).sum()), k) for _ in range(20000)]
    assert np.mean(estimates) == pytest.approx(1 - (1 - p) ** k, abs=0.01)


def test_bootstrap_is_seeded_and_degenerate_cases_collapse():
    rng = np.random.default_rng(0)
    rewards = (rng.random((30, 4)) < 0.4).astype(float)
    a, b = bootstrap_ci(rewards, seed=5), bootstrap_ci(rewards, seed=5)
    assert a == b and a.low < a.value < a.high and a.value == pytest.approx(rewards.mean())
    zeros = bootstrap_ci(np.zeros((10, 3)), "pass_at_k")
    assert (zeros.value, zeros.low, zeros.high) == (0.0, 0.0, 0.0)
    same = paired_difference(rewards, rewards)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)


def _beta(a: float, b: float) -> float:
    return math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))


@pytest.mark.parametrize(
    ("metric", "k", "resample_samples"),
    [("mean_at_k", None, False), ("mean_at_k", None, True), ("pass_at_k", 2, False)],
)
def test_confidence_intervals_cover_the_true_value(metric, k, resample_samples):
    """200 simulated benchmarks: 40 problems with difficulty p ~ Beta(2, 3), 8 samples each. The 95% CI must
    cover the population value in 90-99% of them."""
    rng = np.random.default_rng(2024)
    a, b, n = 2.0, 3.0, 8
    truth = a / (a + b) if metric == "mean_at_k" else 1 - _beta(a, b + k) / _beta(a, b)
    covered = 0
    for experiment in range(200):
        p = rng.beta(a, b, size=40)
        rewards = (rng.random((40, n)) < p[:, None]).astype(float)
        estimate = bootstrap_ci(rewards, metric, k=k, n_boot=1000, seed=experiment, resample_samples=resample_samples)
        covered += estimate.contains(truth)
    assert 0.90 <= covered / 200 <= 0.99, covered / 200


def test_paired_difference_detects_an_improvement_and_not_noise():
    rng = np.random.default_rng(11)
    p = rng.beta(2, 5, size=50)
    base = (rng.random((50, 8)) < p[:, None]).astype(float)
    better = (rng.random((50, 8)) < np.minimum(p + 0.15, 1)[:, None]).astype(float)
    same = (rng.random((50, 8)) < p[:, None]).astype(float)
    improved = paired_difference(base, better, seed=1)
    assert improved.low > 0 and improved.value == pytest.approx(better.mean() - base.mean())
    assert paired_difference(base, same, seed=1).contains(0.0)
    with pytest.raises(ValueError, match="same problems and samples"):
        paired_difference(base, better[:10])


def test_paired_ci_is_narrower_than_unpaired_when_problems_vary():
    """Problem difficulty is shared by both conditions: pairing removes it from the difference's noise."""
    rng = np.random.default_rng(5)
    p = rng.beta(0.5, 0.5, size=60)
    a = (rng.random((60, 4)) < p[:, None]).astype(float)
    b = (rng.random((60, 4)) < np.minimum(p + 0.05, 1)[:, None]).astype(float)
    paired = paired_difference(a, b, seed=0)
    ea, eb = bootstrap_ci(a, seed=1), bootstrap_ci(b, seed=2)
    unpaired_width = math.hypot(ea.high - ea.low, eb.high - eb.low)
    assert paired.high - paired.low < 0.8 * unpaired_width
