"""Which experiences each problem's prompt shows: domain routing and retrieval injection.

By default (``library.injection: all``, no ``dataset.domain_field``) every rollout prompt carries the whole
library, so all prompts of a step share one prefix (what a server's prefix cache reuses). With domain tags, a
problem sees its domain's experiences and the shared (untagged) ones; an untagged problem sees all. With
``injection: top_k``, a problem sees the ``top_k`` of those most similar to it (cosine of embeddings, ties: lower
id) plus the ``pinned`` ids, still in id order. The choice travels with the library version to the rollout and
summarize tasks (``ExperienceLibrary.shown``); the learner stages always see the whole library (they edit it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from clgrpo.experience.library import ExampleView, ExperienceLibrary, normalize_text
from clgrpo.models.embeddings import Embedder, make_embedder, nearest
from schemas.config import RunConfig
from schemas.config_migrations import result_settings
from schemas.records import Experience, Problem, text_hash

Shown = dict[str, list[str]]  # problem id -> the experience ids its prompt shows (id order)


def prompt_routing(config: RunConfig) -> dict[str, Any] | None:
    """What of the config decides which experiences a prompt shows (for evaluation fingerprints): None when
    every prompt gets the whole library."""
    settings = config.library
    routing: dict[str, Any] = {}
    if settings.injection == "top_k":
        routing = {
            "injection": "top_k",
            "top_k": settings.top_k,
            "pinned": settings.pinned,
            "embedding": result_settings(settings.embedding),  # which model embeds, not where or how fast
        }
    if config.dataset.domain_field:
        routing["domain_field"] = config.dataset.domain_field
    return routing or None


def eligible(experience: Experience, problem: Problem) -> bool:
    """A shared experience, an untagged problem, or the same domain."""
    return experience.domain_tag is None or problem.domain_tag is None or experience.domain_tag == problem.domain_tag


def select_experiences(
    library: ExperienceLibrary,
    problems: Sequence[Problem],
    *,
    top_k: int | None = None,
    pinned: Sequence[str] = (),
    vectors: Mapping[str, Sequence[float]] | None = None,
) -> Shown | None:
    """The ids each problem's prompt shows; None when that is the whole library for every problem (the prompt,
    and its hash, stay exactly as without routing). ``top_k``: retrieval (``vectors`` keyed by
    ``normalize_text`` of every lesson and problem text); None: all eligible experiences."""
    tagged = any(e.domain_tag is not None for e in library.lessons)
    if top_k is None and not tagged:
        return None
    pinned_live = [i for i in pinned if i in library]
    shown: Shown = {}
    for members in _by_tag(problems).values():
        candidates = [e for e in library.lessons if eligible(e, members[0]) and e.id not in pinned_live]
        if top_k is None or len(candidates) <= top_k:
            picked = {p.problem_id: [e.id for e in candidates] for p in members}
        else:
            picked = _most_similar(candidates, members, top_k, vectors or {})
        for problem in members:
            wanted = set(picked[problem.problem_id]) | set(pinned_live)
            shown[problem.problem_id] = [e.id for e in library.lessons if e.id in wanted]
    return shown


def _by_tag(problems: Sequence[Problem]) -> dict[str | None, list[Problem]]:
    groups: dict[str | None, list[Problem]] = {}
    for problem in problems:
        groups.setdefault(problem.domain_tag, []).append(problem)
    return groups


def _most_similar(
    candidates: list[Experience], problems: list[Problem], k: int, vectors: Mapping[str, Sequence[float]]
) -> Shown:
    """``candidates`` in library (id) order, so ``nearest``'s ties go to the lower id."""
    lessons = np.asarray([_vector(vectors, e.text) for e in candidates], dtype=np.float32)
    queries = np.asarray([_vector(vectors, p.problem) for p in problems], dtype=np.float32)
    index, _ = nearest(queries, lessons, k, normalized=True)
    return {p.problem_id: [candidates[j].id for j in row] for p, row in zip(problems, index.tolist())}


def _vector(vectors: Mapping[str, Sequence[float]], text: str) -> Sequence[float]:
    try:
        return vectors[normalize_text(text)]
    except KeyError:
        raise KeyError(f"no embedding for {text[:60]!r}: embed every lesson and problem before selecting") from None


# --- with embeddings from the store ---------------------------------------------------------------------------
async def embed_cached(store: Any, embedder: Embedder, texts: Sequence[str]) -> dict[str, list[float]]:
    """Unit-length embeddings of ``texts`` keyed by ``normalize_text``: read from DuckDB (``embeddings``, by model
    and text hash), the missing ones computed once and stored. ``store``: a ``clgrpo.storage.store.Store``, or None
    to embed without the cache (a reader that may not write)."""
    keys = {normalize_text(t): text_hash(normalize_text(t)) for t in texts if t and t.strip()}
    known = store.cached_vectors(embedder.name, sorted(set(keys.values()))) if store is not None else {}
    missing = [k for k, h in keys.items() if h not in known]
    if missing:
        fresh = {keys[k]: v for k, v in zip(missing, await embedder.embed(missing))}
        if store is not None:
            store.store_vectors(embedder.name, fresh)
        known.update(fresh)
    return {k: [float(x) for x in known[h]] for k, h in keys.items()}


async def route_library(
    config: RunConfig, store: Any, library: ExperienceLibrary, problems: Sequence[Problem]
) -> ExperienceLibrary:
    """``library`` carrying which experiences each of ``problems`` is shown (``library.shown``), per the config;
    unchanged when every prompt gets the whole library."""
    settings = config.library
    library = library.with_view(ExampleView(settings.examples_shown, settings.examples_as))
    vectors: dict[str, list[float]] = {}
    needs_vectors = settings.injection == "top_k" and len(library.lessons) > settings.top_k
    if needs_vectors:
        embedder = make_embedder(settings.embedding)
        try:
            vectors = await embed_cached(
                store, embedder, [e.text for e in library.lessons] + [p.problem for p in problems]
            )
        finally:
            await embedder.aclose()
    top_k = settings.top_k if settings.injection == "top_k" else None
    shown = select_experiences(library, problems, top_k=top_k, pinned=settings.pinned, vectors=vectors)
    return library if shown is None else library.with_shown(shown)
