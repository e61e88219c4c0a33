"""Leakage guard: problems that appear in both the training and the evaluation set.

Texts are compared after ``normalize_problem_text`` (case, whitespace, surrounding punctuation). Exact
duplicates match on that key; near-duplicates have a character 5-gram Jaccard similarity >= the threshold and
the same numbers in the same order (by default: problems of one template with other numbers are other
problems, while a reworded copy keeps its numbers).
Near-duplicate candidates come from MinHash signatures with LSH banding (tuned so a pair at the threshold is
found with probability >= 0.9995); each candidate is confirmed with its exact Jaccard similarity, so what is
reported is never a false positive, and thousands of problems on each side take about a second.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from clgrpo.inputs.dataset import normalize_problem_text
from schemas.records import Problem

NGRAM = 5
DEFAULT_THRESHOLD = 0.8
N_PERM = 64  # MinHash permutations
_PRIME = (1 << 31) - 1
_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")
_ESTIMATE_SLACK = 0.2  # 4 standard errors of a 64-permutation estimate at the default threshold


class LeakageError(ValueError):
    """Evaluation problems also appear in the training set and the run was asked to refuse."""


@dataclass(frozen=True)
class Match:
    eval_id: str
    train_id: str
    similarity: float  # character 5-gram Jaccard; 1.0 for exact duplicates
    exact: bool  # the normalized texts are equal


@dataclass(frozen=True)
class LeakageReport:
    n_eval: int
    n_train: int
    threshold: float
    matches: list[Match] = field(default_factory=list)

    @property
    def eval_ids(self) -> list[str]:
        return sorted({m.eval_id for m in self.matches})

    @property
    def exact(self) -> list[Match]:
        return [m for m in self.matches if m.exact]

    @property
    def near(self) -> list[Match]:
        return [m for m in self.matches if not m.exact]

    def __bool__(self) -> bool:
        return bool(self.matches)

    def message(self, limit: int = 20) -> str:
        if not self.matches:
            return (
                f"leakage guard: none of {self.n_eval} evaluation problems appears in the {self.n_train} "
                "training problems"
            )
        shown = ", ".join(
            f"{m.eval_id}~{m.train_id}" + ("" if m.exact else f" ({m.similarity:.2f})") for m in self.matches[:limit]
        )
        more = f" and {len(self.matches) - limit} more" if len(self.matches) > limit else ""
        return (
            f"leakage guard: {len(self.eval_ids)} of {self.n_eval} evaluation problems also appear in the training "
            f"set ({len(self.exact)} exact, {len(self.near)} near-duplicate pairs at Jaccard >= {self.threshold}): "
            f"{shown}{more}"
        )


def shingles(text: str, n: int = NGRAM) -> frozenset[str]:
    """Character n-grams of the normalized text (the whole text when it is shorter than n)."""
    key = normalize_problem_text(text)
    if len(key) <= n:
        return frozenset([key])
    return frozenset(key[i : i + n] for i in range(len(key) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def numbers(text: str) -> tuple[str, ...]:
    return tuple(_NUMBER_RE.findall(text))


class DuplicateIndex:
    """Texts kept so far, asked the guard's question of a new one: is it an exact or near duplicate of one of
    them? What a generator asks to build a held-out set the guard passes (a scan of the texts with the same
    numbers: for hundreds of texts, not for the guard's thousands)."""

    def __init__(self, texts: Iterable[str] = (), threshold: float = DEFAULT_THRESHOLD) -> None:
        self.threshold = threshold
        self._exact: set[str] = set()
        self._by_numbers: dict[tuple[str, ...], list[frozenset[str]]] = defaultdict(list)
        for text in texts:
            self.add(text)

    def __len__(self) -> int:
        return len(self._exact)

    def add(self, text: str) -> None:
        self._exact.add(normalize_problem_text(text))
        self._by_numbers[numbers(text)].append(shingles(text))

    def __contains__(self, text: object) -> bool:
        if not isinstance(text, str):
            return False
        if normalize_problem_text(text) in self._exact:
            return True
        grams = shingles(text)
        return any(jaccard(grams, other) >= self.threshold for other in self._by_numbers.get(numbers(text), []))


def find_leakage(
    train: Sequence[Problem],
    evaluation: Sequence[Problem],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    same_numbers: bool = True,
) -> LeakageReport:
    """Every (evaluation, training) pair that is an exact or near duplicate, best match first per problem.
    ``same_numbers=False`` also reports near-duplicates whose numbers differ."""
    if not 0 < threshold <= 1:
        raise ValueError(f"leakage threshold must be in (0, 1], got {threshold}")
    exact_index: dict[str, list[str]] = defaultdict(list)
    for p in train:
        exact_index[normalize_problem_text(p.problem)].append(p.problem_id)
    matches = [
        Match(e.problem_id, t, 1.0, True)
        for e in evaluation
        for t in exact_index.get(normalize_problem_text(e.problem), [])
    ]
    if threshold < 1:
        exact_pairs = {(m.eval_id, m.train_id) for m in matches}
        near = _near_duplicates(train, evaluation, threshold, same_numbers)
        matches += [m for m in near if (m.eval_id, m.train_id) not in exact_pairs]
    matches.sort(key=lambda m: (m.eval_id, -m.similarity, m.train_id))
    return LeakageReport(len(evaluation), len(train), threshold, matches)


def _signatures(sets: Sequence[frozenset[str]], rng: np.random.Generator) -> NDArray[np.int64]:
    """MinHash signatures ``(len(sets), N_PERM)``: per permutation, the minimum of a random linear hash."""
    vocab: dict[str, int] = {}
    ids = [np.fromiter((vocab.setdefault(g, len(vocab)) for g in s), dtype=np.int64, count=len(s)) for s in sets]
    flat, offsets = np.concatenate(ids), np.cumsum([0] + [len(i) for i in ids[:-1]])
    a = rng.integers(1, _PRIME, size=N_PERM, dtype=np.int64)
    b = rng.integers(0, _PRIME, size=N_PERM, dtype=np.int64)
    signature = np.empty((len(sets), N_PERM), dtype=np.int64)
    for p in range(N_PERM):
        signature[:, p] = np.minimum.reduceat((a[p] * flat + b[p]) % _PRIME, offsets)
    return signature


def _band_rows(threshold: float) -> int:
    """Rows per LSH band: the most selective banding that still finds a pair at the threshold with
    probability >= 0.9995."""
    rows = 1
    while rows < N_PERM and 1 - (1 - threshold ** (rows + 1)) ** (N_PERM // (rows + 1)) >= 0.9995:
        rows += 1
    return rows


def _band_pairs(keys_eval: NDArray[np.uint64], keys_train: NDArray[np.uint64]) -> NDArray[np.int64]:
    """All (eval, train) index pairs with equal band keys, as codes ``eval * n_train + train``."""
    order = np.argsort(keys_train, kind="stable")
    ordered = keys_train[order]
    lo = np.searchsorted(ordered, keys_eval, side="left")
    counts = np.searchsorted(ordered, keys_eval, side="right") - lo
    eval_idx = np.repeat(np.arange(len(keys_eval), dtype=np.int64), counts)
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    train_idx = order[np.arange(counts.sum()) + starts]
    return eval_idx * len(keys_train) + train_idx


def _band_keys(band: NDArray[np.int64], multipliers: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """One hash per row of a band (uint64 arithmetic wraps; a rare collision only adds a candidate)."""
    return (band.astype(np.uint64) * multipliers).sum(axis=1, dtype=np.uint64)


def _candidates(sig_eval: NDArray[np.int64], sig_train: NDArray[np.int64], threshold: float) -> NDArray[np.int64]:
    """Candidate pairs ``(m, 2)``: equal signatures on at least one LSH band."""
    rows = _band_rows(threshold)
    odd = np.random.default_rng(1).integers(1, 2**62, size=rows, dtype=np.int64) | 1
    multipliers = odd.astype(np.uint64)
    codes = []
    for start in range(0, N_PERM - rows + 1, rows):
        band = slice(start, start + rows)
        codes.append(
            _band_pairs(_band_keys(sig_eval[:, band], multipliers), _band_keys(sig_train[:, band], multipliers))
        )
    unique = np.unique(np.concatenate(codes))
    return np.stack([unique // len(sig_train), unique % len(sig_train)], axis=1)


def _near_duplicates(
    train: Sequence[Problem], evaluation: Sequence[Problem], threshold: float, same_numbers: bool
) -> list[Match]:
    """LSH candidates, pruned by their MinHash estimate (far below the threshold: certainly not similar),
    then confirmed with the exact Jaccard similarity."""
    if not train or not evaluation:
        return []
    train_sets = [shingles(p.problem) for p in train]
    eval_sets = [shingles(p.problem) for p in evaluation]
    signatures = _signatures([*eval_sets, *train_sets], np.random.default_rng(0))
    sig_eval, sig_train = signatures[: len(eval_sets)], signatures[len(eval_sets) :]
    pairs = _candidates(sig_eval, sig_train, threshold)
    kept = [
        chunk[(sig_eval[chunk[:, 0]] == sig_train[chunk[:, 1]]).mean(axis=1) >= threshold - _ESTIMATE_SLACK]
        for chunk in np.array_split(pairs, max(1, len(pairs) // 50_000))
    ]
    found = []
    for i, j in np.concatenate(kept).tolist():
        if same_numbers and numbers(evaluation[i].problem) != numbers(train[j].problem):
            continue
        similarity = jaccard(eval_sets[i], train_sets[j])
        if similarity >= threshold:
            found.append(Match(evaluation[i].problem_id, train[j].problem_id, round(similarity, 4), False))
    return found


def check_leakage(
    train: Sequence[Problem],
    evaluation: Sequence[Problem],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    refuse: bool = False,
    same_numbers: bool = True,
) -> LeakageReport:
    """Find leakage; with ``refuse`` any match raises ``LeakageError`` naming the problem ids."""
    report = find_leakage(train, evaluation, threshold, same_numbers=same_numbers)
    if report and refuse:
        raise LeakageError(report.message() + " (refused: remove them from one set, or run without refusing)")
    return report
