"""The experience library: immutable versions, stable ids, batch operations with explicit outcomes.

Ids (``E17``) are assigned once and never renumbered or reused: deleted and merged-away ids are retired.
Every operation of a batch comes back ``applied`` or ``rejected`` with a reason; nothing is skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from clgrpo.experience.tokens import estimate_tokens
from clgrpo.inputs.leakage import jaccard
from schemas.records import (
    Experience,
    ExperienceStat,
    LibraryVersion,
    Operation,
    OperationResult,
    OpKind,
    OpStatus,
    Problem,
    WorkedExample,
    text_hash,
    utcnow,
)

DEFAULT_MAX_WORDS = 32
EXAMPLE_MAX_WORDS = 400  # an example's solution is a whole worked answer, not a one-line lesson
EXAMPLE_HEADER = "Worked example"  # how a text export opens an example
Screen = Callable[[Operation], str | None]  # an operation with a text -> a rejection reason, or None
NEAR_DUPLICATE = "near-duplicate"  # how near-duplicate outcomes start their reason (counted per step)


@dataclass(frozen=True)
class NearDuplicates:
    """Near-duplicate control: an add or modify whose text is within ``threshold`` cosine similarity of a live
    experience (other than the one it modifies) is rejected, or, with ``mode`` "merge", an add is merged into
    that experience (its text kept, the add's source groups joined to it). ``vectors``: unit-length embeddings
    keyed by ``normalize_text`` of every text the batch may compare (the library's and the operations')."""

    vectors: Mapping[str, Sequence[float]]
    threshold: float = 0.9
    mode: str = "reject"
    blocked: Sequence[tuple[str, str]] = ()  # (text, reason) of lessons not to learn again (their vectors too)

    def blocked_by(self, text: str) -> str | None:
        """Why ``text`` may not be learned: a blocked lesson at or above the threshold, with the similarity."""
        query = self.vectors.get(normalize_text(text))
        for other, reason in self.blocked:
            vector = self.vectors.get(normalize_text(other))
            if query is None or vector is None:
                continue
            similarity = float(sum(a * b for a, b in zip(query, vector)))
            if similarity >= self.threshold:
                return f"near a lesson rejected before (cosine {similarity:.3f}): {reason}"
        return None

    def nearest(self, text: str, live: Iterable[Experience], ignore: Iterable[str] = ()) -> tuple[str, float] | None:
        """The most similar live experience at or above the threshold, with its similarity."""
        query = self.vectors.get(normalize_text(text))
        if query is None:
            raise KeyError(f"no embedding for {text!r}: embed every operation text before applying")
        skip, best = set(ignore), None
        for exp in live:
            vector = self.vectors.get(normalize_text(exp.text))
            if exp.id in skip or vector is None:
                continue
            similarity = float(sum(a * b for a, b in zip(query, vector)))
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (exp.id, similarity)
        return best


_ID_RE = re.compile(r"^([A-Za-z_]*)(\d+)$")
_PROMPT_LINE_RE = re.compile(r"^\s*\[([^\]]+)\]\.?\s*(.*)$")


class LibraryFormatError(ValueError):
    """A library file or payload that cannot be imported."""


def normalize_text(text: str) -> str:
    """Whitespace-collapsed, case-folded text: the key for duplicate detection."""
    return " ".join(text.split()).casefold()


def word_count(text: str) -> int:
    """Words with at least one letter or digit: a lone "." or "-" is not a word."""
    return sum(any(ch.isalnum() for ch in token) for token in text.split())


def _id_number(exp_id: str) -> int | None:
    match = _ID_RE.match(exp_id)
    return int(match.group(2)) if match else None


@dataclass(frozen=True)
class Diff:
    added: list[Experience] = field(default_factory=list)
    removed: list[Experience] = field(default_factory=list)
    modified: list[tuple[Experience, Experience]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.modified)

    def to_markdown(self) -> str:
        lines = [f"+ [{e.id}] {item_text(e)}" for e in self.added]
        lines += [f"- [{e.id}] {item_text(e)}" for e in self.removed]
        lines += [f"~ [{old.id}] {old.text}\n  -> {new.text}" for old, new in self.modified]
        return "\n".join(lines) if lines else "(no changes)"


class _Batch:
    """Mutable working state while one batch of operations is applied."""

    def __init__(
        self,
        lib: "ExperienceLibrary",
        step: int,
        max_words: int,
        min_words: int = 1,
        screen: Screen | None = None,
        near: NearDuplicates | None = None,
        domains: Mapping[str, str | None] | None = None,
    ) -> None:
        self.live: dict[str, Experience] = dict(lib.by_id)
        self.retired: set[str] = set(lib.retired_ids)
        self.next_id = lib.next_id
        self.prefix = lib.id_prefix
        self.step = step
        self.max_words = max_words
        self.min_words = min_words
        self.screen = screen
        self.near = near
        self.touched: dict[str, int] = {}  # id -> seq of the applied operation that touched it
        self.notes: dict[int, str] = {}  # seq -> why an applied operation did not do what it said
        self.domains = domains or {}  # problem id (source group) -> its domain tag

    def domain_tag(self, groups: Iterable[str], own: Iterable[str | None] = ()) -> str | None:
        """The domain a lesson from ``groups`` (and, for a modify or merge, lessons with tags ``own``) belongs to:
        their one common tag, else None (shared by every domain)."""
        tags = {self.domains[g] for g in groups if g in self.domains} | set(own)
        return tags.pop() if len(tags) == 1 else None

    def new_id(self) -> str:
        exp_id = f"{self.prefix}{self.next_id}"
        self.next_id += 1
        return exp_id

    def duplicate_of(self, text: str, ignore: Iterable[str] = ()) -> str | None:
        key = normalize_text(text)
        skip = set(ignore)
        for exp in self.live.values():
            if exp.id not in skip and normalize_text(exp.text) == key:
                return exp.id
        return None

    # --- checks; each returns a rejection reason or None -------------------------------------------------
    def check_ids(self, ids: Sequence[str]) -> str | None:
        for exp_id in ids:
            if exp_id in self.touched:
                return f"conflict: {exp_id} already changed by operation #{self.touched[exp_id]} in this batch"
            if exp_id in self.retired:
                return f"deleted id: {exp_id} was deleted or merged earlier"
            if exp_id not in self.live:
                return f"unknown id: {exp_id}"
        if len(set(ids)) != len(ids):
            return f"repeated id in {list(ids)}"
        return None

    def check_text(self, text: str | None, replacing: Iterable[str] = ()) -> str | None:
        if text is None or not text.strip():
            return "empty text"
        words = word_count(text)
        if words > self.max_words:
            return f"too long: {words} words (limit {self.max_words})"
        if words < self.min_words:
            return f"too short: {words} word(s) (minimum {self.min_words})"
        dup = self.duplicate_of(text, ignore=replacing)
        if dup is not None:
            return f"duplicate of live experience {dup}"
        return None


@dataclass(frozen=True)
class ExampleView:
    """How a library's worked examples are shown at answer time (``library.examples_shown`` and
    ``library.examples_as``): at most ``shown`` per problem, as prior chat ``turns`` or a ``block`` beside the
    lessons. It travels with the library version, like ``shown``."""

    shown: int = 2
    form: str = "turns"


_WORD_RE = re.compile(r"[^\W\d_]+")


def _words(text: str) -> frozenset[str]:
    """The words of a text without its numbers: problems of one kind share them whatever their numbers."""
    return frozenset(w.casefold() for w in _WORD_RE.findall(text))


def problem_similarity(a: str, b: str) -> float:
    """Word-set overlap (Jaccard) of two problem texts, numbers left out: how an example is matched to a problem."""
    return jaccard(_words(a), _words(b))


_ARITY = {OpKind.ADD: (0, 0), OpKind.MODIFY: (1, 1), OpKind.DELETE: (1, 1), OpKind.KEEP: (1, 1)}


class ExperienceLibrary:
    """One immutable version of the library."""

    def __init__(
        self,
        experiences: Iterable[Experience] = (),
        *,
        version: int = 0,
        step: int = 0,
        parent_version: int | None = None,
        next_id: int | None = None,
        id_prefix: str = "E",
        retired_ids: Iterable[str] = (),
        shown: Mapping[str, Sequence[str]] | None = None,
        view: ExampleView = ExampleView(),
    ) -> None:
        self._items: tuple[Experience, ...] = tuple(experiences)
        self.shown = None if shown is None else {k: list(v) for k, v in shown.items()}
        self.view = view
        self.by_id: dict[str, Experience] = {e.id: e for e in self._items}
        if len(self.by_id) != len(self._items):
            raise LibraryFormatError("experience ids must be unique")
        self.version = version
        self.step = step
        self.parent_version = parent_version
        self.id_prefix = id_prefix
        self.retired_ids: frozenset[str] = frozenset(retired_ids)
        numbers = [n for n in map(_id_number, [*self.by_id, *self.retired_ids]) if n is not None]
        floor = max(numbers) + 1 if numbers else 0
        self.next_id = max(next_id if next_id is not None else 0, floor)

    # --- reading ----------------------------------------------------------------------------------------
    @property
    def experiences(self) -> tuple[Experience, ...]:
        return self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Experience]:
        return iter(self._items)

    def __contains__(self, exp_id: object) -> bool:
        return exp_id in self.by_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExperienceLibrary):
            return NotImplemented
        return self.as_dict() == other.as_dict() and self.next_id == other.next_id

    @property
    def lessons(self) -> tuple[Experience, ...]:
        return tuple(e for e in self._items if e.example is None)

    @property
    def examples(self) -> tuple[Experience, ...]:
        return tuple(e for e in self._items if e.example is not None)

    def as_dict(self) -> dict[str, str | dict[str, object]]:
        """Id -> a lesson's text, or an example as an object (its problem, solution and provenance)."""
        return {e.id: e.text if e.example is None else example_payload(e) for e in self._items}

    def content_hash(self) -> str:
        return text_hash(json.dumps(self.as_dict(), sort_keys=True))

    def render_for_prompt(self, ids: Iterable[str] | None = None) -> str:
        """One line per lesson, ``[id]. text``, in id order; empty string for a library without lessons. ``ids``:
        only those lessons (retrieval injection, domain routing), still in id order. Examples are shown apart
        (``examples_for``)."""
        wanted = None if ids is None else set(ids)
        return "\n".join(_prompt_line(e) for e in self.lessons if wanted is None or e.id in wanted)

    def prompt_text_for(self, problem_id: str) -> str:
        """The lesson block of one problem's rollout prompt: the lessons ``shown`` to it (all if unrouted)."""
        ids = None if self.shown is None else self.shown.get(problem_id)
        return self.render_for_prompt(ids)

    def examples_for(self, problem: Problem) -> list[Experience]:
        """The worked examples one problem's prompt shows: at most ``view.shown``, never one of the problem itself
        (by id or text), only of its domain (or shared), those of its task tag first, then the most similar
        problem texts (word overlap, numbers left out), ties the lower id."""
        own = normalize_text(problem.problem)
        candidates = [
            e
            for e in self.examples
            if e.example is not None
            and problem.problem_id not in e.source_groups
            and normalize_text(e.example.problem) != own
            and (e.domain_tag is None or problem.domain_tag is None or e.domain_tag == problem.domain_tag)
        ]

        def rank(e: Experience) -> tuple[bool, float, tuple[int, str]]:
            assert e.example is not None
            same_tag = problem.tag is not None and e.example.task_tag == problem.tag
            return (not same_tag, -problem_similarity(e.example.problem, problem.problem), _sort_key(e))

        return sorted(candidates, key=rank)[: self.view.shown]

    def with_shown(self, shown: Mapping[str, Sequence[str]]) -> "ExperienceLibrary":
        """This version, routing each problem's prompt to the ids in ``shown`` (``clgrpo.experience.retrieval``)."""
        return self._derived(self._items, shown=shown)

    def with_view(self, view: ExampleView) -> "ExperienceLibrary":
        """This version, showing its examples as ``view`` says (``library.examples_shown``, ``examples_as``)."""
        return self._derived(self._items, view=view)

    def _derived(self, items: Iterable[Experience], **changes: object) -> "ExperienceLibrary":
        """A library of ``items`` with this one's version, ids, routing and view, but for ``changes``."""
        settings: dict[str, object] = dict(
            version=self.version,
            step=self.step,
            parent_version=self.parent_version,
            next_id=self.next_id,
            id_prefix=self.id_prefix,
            retired_ids=self.retired_ids,
            shown=self.shown,
            view=self.view,
        )
        return ExperienceLibrary(items, **(settings | changes))  # type: ignore[arg-type]

    def prompt_tokens(self) -> int:
        """Estimated tokens of the rendered lessons (``clgrpo.experience.tokens``): what ``library.max_tokens`` bounds.
        The examples are bounded by count instead (``library.examples_shown`` per prompt)."""
        return sum(estimate_tokens(_prompt_line(e)) for e in self.lessons)

    # --- applying operations ----------------------------------------------------------------------------
    def apply(
        self,
        operations: Sequence[Operation],
        *,
        step: int,
        max_words: int = DEFAULT_MAX_WORDS,
        max_size: int | None = None,
        min_words: int = 1,
        screen: Screen | None = None,
        near: NearDuplicates | None = None,
        domains: Mapping[str, str | None] | None = None,
    ) -> tuple["ExperienceLibrary", list[OperationResult]]:
        """Apply a batch in order; returns the new version and one result per operation. ``screen`` may refuse
        a lesson text with a reason (e.g. text copied from the learner's prompt); ``near`` controls near-
        duplicates of live experiences (embeddings); ``domains`` maps problem ids to domain tags (a lesson takes
        the common tag of its source problems, else it is shared)."""
        batch = _Batch(self, step, max_words, min_words, screen, near, domains)
        results = []
        for seq, op in enumerate(operations):
            reason, result_id = self._apply_one(batch, op, seq, max_size)
            status = OpStatus.REJECTED if reason else OpStatus.APPLIED
            results.append(
                OperationResult(
                    seq=seq, operation=op, status=status, reason=reason or batch.notes.get(seq, ""), result_id=result_id
                )
            )
        new = ExperienceLibrary(
            sorted(batch.live.values(), key=_sort_key),
            version=self.version + 1,
            step=step,
            parent_version=self.version,
            next_id=batch.next_id,
            id_prefix=self.id_prefix,
            retired_ids=batch.retired,
            view=self.view,
        )
        return new, results

    def _apply_one(self, batch: _Batch, op: Operation, seq: int, max_size: int | None) -> tuple[str | None, str | None]:
        ids = op.target_ids
        if op.op == OpKind.EVICT:
            return "evict is not an edit: only the token budget evicts (library.max_tokens)", None
        if op.op == OpKind.MERGE:
            if len(set(ids)) < 2:
                return f"merge needs at least 2 distinct live ids, got {ids}", None
        elif op.op in _ARITY and len(ids) != _ARITY[op.op][0]:
            want = "no ids" if op.op == OpKind.ADD else "exactly one id"
            return f"{op.op.value} takes {want}, got {ids}", None
        reason = batch.check_ids(ids)
        if reason:
            return reason, None
        if op.op == OpKind.KEEP:
            batch.touched[ids[0]] = seq
            return None, ids[0]
        if op.op == OpKind.DELETE:
            return None, self._delete(batch, ids[0], seq)
        if op.example is not None:
            return self._add_example(batch, op, seq, max_size)
        reason = batch.check_text(op.text, replacing=ids) or (batch.screen(op) if batch.screen else None)
        if reason:
            return reason, None
        text = " ".join(op.text.split())  # type: ignore[union-attr]  # check_text rejected a missing text
        if batch.near is not None and (blocked := batch.near.blocked_by(text)):
            return blocked, None
        if batch.near is not None and op.op in (OpKind.ADD, OpKind.MODIFY):
            found = batch.near.nearest(text, batch.live.values(), ignore=ids)
            if found is not None:
                return self._near_duplicate(batch, batch.near, op, found, seq)
        if op.op == OpKind.ADD:
            if max_size is not None and len(batch.live) >= max_size:
                return f"library full: {len(batch.live)} experiences (limit {max_size})", None
            return None, self._add(batch, text, [], op.source_groups, seq)
        if op.op == OpKind.MODIFY:
            if normalize_text(text) == normalize_text(batch.live[ids[0]].text):
                return f"unchanged: text identical to {ids[0]}", None
            return None, self._modify(batch, ids[0], text, op.source_groups, seq)
        return None, self._merge(batch, ids, text, op.source_groups, seq)

    @staticmethod
    def _near_duplicate(
        batch: _Batch, near: NearDuplicates, op: Operation, found: tuple[str, float], seq: int
    ) -> tuple[str | None, str | None]:
        """Reject, or (mode "merge", an add) fold the add into its near-duplicate: the text stays, the sources
        join. The reason of an applied merge goes into the result through ``batch.notes``."""
        exp_id, similarity = found
        where = f"{NEAR_DUPLICATE} of live experience {exp_id} (cosine {similarity:.3f} >= {near.threshold:g})"
        if near.mode != "merge" or op.op != OpKind.ADD:
            return where, None
        old = batch.live[exp_id]
        batch.live[exp_id] = old.model_copy(
            update={"source_groups": list(dict.fromkeys([*old.source_groups, *op.source_groups]))}
        )
        batch.touched[exp_id] = seq
        batch.notes[seq] = f"{where}: merged into it (its text kept, the sources joined)"
        return None, exp_id

    @staticmethod
    def _add_example(batch: _Batch, op: Operation, seq: int, max_size: int | None) -> tuple[str | None, str | None]:
        """A worked example: only ever added (a solution is not reworded or merged), once per problem, within
        ``EXAMPLE_MAX_WORDS``, and through the screen (the guard's checks against injected instructions)."""
        example = op.example
        assert example is not None
        if op.op != OpKind.ADD:
            return f"a worked example can only be added, not {op.op.value}d", None
        text = (op.text or "").strip()
        if not text:
            return "empty solution", None
        if (words := word_count(text)) > EXAMPLE_MAX_WORDS:
            return f"too long: a solution of {words} words (limit {EXAMPLE_MAX_WORDS})", None
        same = normalize_text(example.problem)
        for exp in batch.live.values():
            if exp.example is not None and normalize_text(exp.example.problem) == same:
                return f"duplicate: live example {exp.id} already solves this problem", None
        if batch.screen is not None and (reason := batch.screen(op)):
            return reason, None
        if max_size is not None and len(batch.live) >= max_size:
            return f"library full: {len(batch.live)} experiences (limit {max_size})", None
        exp_id = ExperienceLibrary._add(batch, text, [], op.source_groups, seq)
        batch.live[exp_id] = batch.live[exp_id].model_copy(update={"example": example})
        return None, exp_id

    @staticmethod
    def _add(batch: _Batch, text: str, parents: list[str], groups: list[str], seq: int) -> str:
        exp_id = batch.new_id()
        batch.live[exp_id] = Experience(
            id=exp_id,
            text=text,
            created_step=batch.step,
            updated_step=batch.step,
            parent_ids=parents,
            source_groups=list(dict.fromkeys(groups)),
            domain_tag=batch.domain_tag(groups),
        )
        batch.touched[exp_id] = seq
        return exp_id

    @staticmethod
    def _modify(batch: _Batch, exp_id: str, text: str, groups: list[str], seq: int) -> str:
        old = batch.live[exp_id]
        batch.live[exp_id] = old.model_copy(
            update={
                "text": text,
                "updated_step": batch.step,
                "source_groups": list(dict.fromkeys([*old.source_groups, *groups])),
                "domain_tag": batch.domain_tag(groups, [old.domain_tag]),
            }
        )
        batch.touched[exp_id] = seq
        return exp_id

    @staticmethod
    def _delete(batch: _Batch, exp_id: str, seq: int) -> str:
        del batch.live[exp_id]
        batch.retired.add(exp_id)
        batch.touched[exp_id] = seq
        return exp_id

    def _merge(self, batch: _Batch, ids: list[str], text: str, groups: list[str], seq: int) -> str:
        inherited = [g for exp_id in ids for g in batch.live[exp_id].source_groups]
        tags = [batch.live[exp_id].domain_tag for exp_id in ids]
        for exp_id in ids:
            self._delete(batch, exp_id, seq)
        exp_id = self._add(batch, text, list(ids), [*inherited, *groups], seq)
        batch.live[exp_id] = batch.live[exp_id].model_copy(update={"domain_tag": batch.domain_tag(groups, tags)})
        return exp_id

    # --- the token budget -------------------------------------------------------------------------------
    def evict_to_budget(
        self, max_tokens: int, stats: Mapping[str, ExperienceStat], first_seq: int = 0
    ) -> tuple["ExperienceLibrary", list[OperationResult]]:
        """Remove experiences until the rendered library fits ``max_tokens``: lowest confidence first (a lesson
        with no stats counts as never cited), ties the oldest (created first, then lowest id). Each removal is
        an applied ``evict`` result whose reason gives the usefulness and the token counts; evicted ids are
        retired (never reused). The version number stays: eviction is part of the step that overflowed."""
        tokens = {e.id: estimate_tokens(_prompt_line(e)) for e in self.lessons}
        total = sum(tokens.values())
        if total <= max_tokens:
            return self, []
        ranked = sorted(self.lessons, key=lambda e: (_confidence(stats.get(e.id)), e.created_step, _sort_key(e)))
        evicted: set[str] = set()
        results: list[OperationResult] = []
        for exp in ranked:
            if total <= max_tokens:
                break
            after = total - tokens[exp.id]
            reason = (
                f"over the token budget: library {total} tokens > library.max_tokens={max_tokens}; lowest "
                f"usefulness: {_usefulness(stats.get(exp.id))}, created step {exp.created_step}; "
                f"{after} tokens after"
            )
            op = Operation(
                op=OpKind.EVICT, target_ids=[exp.id], text=exp.text, rationale=reason, source_groups=exp.source_groups
            )
            results.append(
                OperationResult(
                    seq=first_seq + len(results), operation=op, status=OpStatus.APPLIED, reason=reason, result_id=exp.id
                )
            )
            evicted.add(exp.id)
            total = after
        kept = self._derived([e for e in self._items if e.id not in evicted], retired_ids=self.retired_ids | evicted)
        return kept, results

    # --- versions and diffs -----------------------------------------------------------------------------
    def to_version(self) -> LibraryVersion:
        return LibraryVersion(
            version=self.version,
            step=self.step,
            parent_version=self.parent_version,
            experiences=list(self._items),
            retired_ids=sorted(self.retired_ids),
            next_id=self.next_id,
            id_prefix=self.id_prefix,
            created_at=utcnow(),
            shown=self.shown,
            examples_shown=self.view.shown,
            examples_as=self.view.form,
        )

    @classmethod
    def from_version(cls, v: LibraryVersion) -> "ExperienceLibrary":
        return cls(
            v.experiences,
            version=v.version,
            step=v.step,
            parent_version=v.parent_version,
            next_id=v.next_id,
            id_prefix=v.id_prefix,
            retired_ids=v.retired_ids,
            shown=v.shown,
            view=ExampleView(v.examples_shown, v.examples_as),
        )

    # --- import / export ------------------------------------------------------------------------------
    def to_reference(self) -> dict[str, str | dict[str, object]]:
        """The reference implementation's format: ``{"G0": "text", ...}`` (an example: an object)."""
        return self.as_dict()

    def to_seed(self) -> dict[str, object]:
        return {"experiences": self.as_dict(), "next_id": self.next_id}

    def to_prompt_text(self) -> str:
        """The lessons as the prompt's block shows them, then each worked example as "Solved example" lines
        (a text file keeps examples for reading; import them from a JSON format)."""
        blocks = [self.render_for_prompt()] if self.lessons else []
        blocks += [
            f"[{e.id}]. {EXAMPLE_HEADER} {_example_note(e.example)}\n{e.text}"
            for e in self.examples
            if e.example is not None
        ]
        return "\n\n".join(blocks)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, object], *, next_id: int | None = None, step: int = 0
    ) -> "ExperienceLibrary":
        """Id -> a lesson's text, or an example as an object (``example_payload``'s fields)."""
        if not isinstance(mapping, dict):
            raise LibraryFormatError(f"experiences must be an object of id -> text, got {type(mapping).__name__}")
        items = []
        for exp_id, value in mapping.items():
            if isinstance(value, dict):
                items.append(_example_from_payload(str(exp_id), value, step))
                continue
            if not isinstance(value, str) or not value.strip():
                raise LibraryFormatError(
                    f"experience {exp_id!r}: text must be a non-empty string (or, for an example, an object)"
                )
            items.append(Experience(id=str(exp_id), text=value, created_step=step, updated_step=step))
        return cls(sorted(items, key=_sort_key), next_id=next_id, id_prefix=_infer_prefix(mapping), step=step)

    @classmethod
    def from_reference(cls, payload: dict[str, object]) -> "ExperienceLibrary":
        return cls.from_mapping(payload)

    @classmethod
    def from_seed(cls, payload: dict[str, object]) -> "ExperienceLibrary":
        if not isinstance(payload, dict) or "experiences" not in payload:
            raise LibraryFormatError('seed format needs {"experiences": {...}, "next_id": N}')
        next_id = payload.get("next_id")
        if next_id is not None and not isinstance(next_id, int):
            raise LibraryFormatError(f"seed format: next_id must be an integer, got {next_id!r}")
        return cls.from_mapping(payload["experiences"], next_id=next_id)  # type: ignore[arg-type]  # it checks the shape

    @classmethod
    def from_prompt_text(cls, text: str) -> "ExperienceLibrary":
        """Parse a system-prompt block: ``[id]. text`` lines keep their ids; other non-empty lines
        (``- text``, ``1. text``, plain) get fresh ids after the highest one seen."""
        named: dict[str, str] = {}
        unnamed: list[str] = []
        if EXAMPLE_HEADER in text:
            raise LibraryFormatError(
                "a text library with worked examples cannot be imported (a solution spans lines): export it with "
                "--format reference or seed"
            )
        for line in text.splitlines():
            match = _PROMPT_LINE_RE.match(line)
            if match and match.group(2).strip():
                named[match.group(1).strip()] = match.group(2).strip()
            elif line.strip():
                unnamed.append(re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", line).strip())
        prefix = _infer_prefix(named) if named else "E"
        numbers = [n for n in map(_id_number, named) if n is not None]
        first = max(numbers) + 1 if numbers else 0
        mapping = {**named, **{f"{prefix}{first + i}": t for i, t in enumerate(unnamed)}}
        return cls.from_mapping(mapping)

    @classmethod
    def load(cls, path: str | Path) -> "ExperienceLibrary":
        """Import a file in any supported format (reference JSON, seed JSON, or a text block)."""
        path = Path(path)
        raw = path.read_text(encoding="utf-8")
        if path.suffix.lower() != ".json":
            return cls.from_prompt_text(raw)
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LibraryFormatError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        try:
            if isinstance(payload, dict) and "experiences" in payload:
                return cls.from_seed(payload)
            return cls.from_reference(payload)
        except LibraryFormatError as exc:
            raise LibraryFormatError(f"{path}: {exc}") from exc

    def dump(self, path: str | Path, fmt: str = "reference") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.dumps(fmt), encoding="utf-8")
        return path

    def dumps(self, fmt: str = "reference") -> str:
        if fmt == "reference":
            return json.dumps(self.to_reference(), indent=2, ensure_ascii=False)
        if fmt == "seed":
            return json.dumps(self.to_seed(), indent=2, ensure_ascii=False)
        if fmt == "text":
            return self.to_prompt_text() + "\n"
        raise ValueError(f"unknown library format {fmt!r}; use reference, seed or text")


def describe_operation(step: int, r: OperationResult) -> str:
    """One line per operation: ``step 2 #1 rejected add "text": reason [from p3]``."""
    op = r.operation
    ids = f" {','.join(op.target_ids)}" if op.target_ids else ""
    text = f' "{op.text}"' if op.text else ""
    if op.example is not None:
        text = f" example {_example_note(op.example, op.text or '')}"
    result = f" -> {r.result_id}" if r.status == OpStatus.APPLIED and r.result_id else ""
    reason = f": {r.reason}" if r.reason else ""
    sources = f" [from {', '.join(op.source_groups)}]" if op.source_groups else ""
    return f"  step {step} #{r.seq} {r.status.value:<8} {op.op.value}{ids}{text}{result}{reason}{sources}"


def diff(old: ExperienceLibrary, new: ExperienceLibrary) -> Diff:
    """What changed from ``old`` to ``new``, by stable id."""
    added = [e for e in new if e.id not in old]
    removed = [e for e in old if e.id not in new]
    modified = [(old.by_id[e.id], e) for e in new if e.id in old and old.by_id[e.id].text != e.text]
    return Diff(added=added, removed=removed, modified=modified)


def _prompt_line(exp: Experience) -> str:
    return f"[{exp.id}]. {exp.text}"


def item_text(exp: Experience, *, solution: bool = True) -> str:
    """A library item in one line: a lesson's text, or an example's answer, provenance, problem and (``solution``)
    its solution."""
    if exp.example is None:
        return exp.text
    return f"example {_example_note(exp.example, exp.text if solution else None)}"


def _example_note(example: WorkedExample, solution: str | None = None) -> str:
    """An example's answer, provenance and problem in one line, and its solution when given."""
    note = (
        f"(answer {example.answer}; {example.origin} by {example.author or 'unknown'}, reward {example.reward:g}): "
        f'problem "{" ".join(example.problem.split())}"'
    )
    return note if solution is None else f'{note} solution "{" ".join(solution.split())}"'


EXAMPLE_FIELDS = ("problem", "answer", "author", "reward", "origin", "task_tag")


def example_payload(exp: Experience) -> dict[str, object]:
    """An example as a library file holds it: ``kind``, its problem, solution (``text``), answer, provenance."""
    assert exp.example is not None
    fields = exp.example.model_dump(mode="json", include=set(EXAMPLE_FIELDS))
    return {"kind": "example", "problem": fields.pop("problem"), "text": exp.text, **fields,
            "source_groups": list(exp.source_groups)}  # fmt: skip


def _example_from_payload(exp_id: str, payload: Mapping[str, object], step: int) -> Experience:
    """An example item read from a library file; one error naming the item and what is wrong."""
    if payload.get("kind") != "example":
        raise LibraryFormatError(f'experience {exp_id!r}: an object must be an example ("kind": "example")')
    unknown = sorted(set(payload) - {"kind", "text", "source_groups", *EXAMPLE_FIELDS})
    if unknown:
        raise LibraryFormatError(f"experience {exp_id!r}: unknown field(s) {', '.join(unknown)}")
    text, groups = payload.get("text"), payload.get("source_groups", [])
    if not isinstance(text, str) or not text.strip():
        raise LibraryFormatError(f"experience {exp_id!r}: an example needs its solution as a non-empty `text`")
    if not isinstance(groups, list):
        raise LibraryFormatError(f"experience {exp_id!r}: source_groups must be a list of problem ids")
    fields = {k: payload[k] for k in EXAMPLE_FIELDS if k in payload}
    try:
        example = WorkedExample.model_validate({"origin": "file", **fields})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise LibraryFormatError(f"experience {exp_id!r}: {where}: {first['msg']}") from None
    return Experience(
        id=exp_id, text=text, created_step=step, updated_step=step, source_groups=[str(g) for g in groups],
        example=example,
    )  # fmt: skip


def _confidence(stat: ExperienceStat | None) -> float:
    return 0.5 if stat is None else stat.confidence  # Beta(1, 1) mean: never cited


def _usefulness(stat: ExperienceStat | None) -> str:
    if stat is None or not stat.cited:
        return "confidence 0.50 (never cited)"
    return (
        f"confidence {stat.confidence:.2f} (cited {stat.cited}x: {stat.cited_correct:g} correct / "
        f"{stat.cited_wrong:g} wrong)"
    )


def _sort_key(exp: Experience) -> tuple[int, str]:
    number = _id_number(exp.id)
    return (number if number is not None else 10**9, exp.id)


def _infer_prefix(mapping: dict[str, str]) -> str:
    prefixes = {m.group(1) for m in (_ID_RE.match(str(k)) for k in mapping) if m}
    return prefixes.pop() if len(prefixes) == 1 else "E"
