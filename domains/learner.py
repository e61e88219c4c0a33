"""The learner's logic around its prompts: the JSON schemas its replies are held to, the domain's wording
(``LearnerPrompts``: the domain's description and example lessons applied to the role templates of
``clgrpo.prompts``), and the lesson screen (``LessonScreen``: prompt copies, problem copies, loops).

The wording itself lives in ``clgrpo.prompts`` (one module per role); the system messages start with a ``ROLE:``
line so logs and test servers can tell the stages apart. Operations are requested as JSON; ``operations_schema``
gives the per-kind schema that constrained decoding enforces, and every prompt shows a complete, concrete example
reply (no placeholders). Problem text is data: see ``clgrpo.prompts.quoting``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clgrpo.prompts import consolidate, contrast, extract, lessons, repair, summarize
from clgrpo.prompts.lessons import LessonAsk
from schemas.config import LearningConfig
from schemas.records import Operation, Problem

OP_KINDS = ["add", "modify", "delete", "merge", "keep"]
GROUP_KINDS = ("add", "modify")  # what one group may propose; consolidation may use every kind

CHARS_PER_WORD_MIN = 4  # schema bounds on a lesson's length in characters, from its bounds in words
CHARS_PER_WORD_MAX = 12


def _lesson_text(min_words: int, max_words: int, pattern: str | None) -> dict:
    if pattern:  # grammar engines do not combine a pattern with length bounds; the library checks the words
        return {"type": "string", "pattern": pattern}
    return {"type": "string", "minLength": CHARS_PER_WORD_MIN * min_words, "maxLength": CHARS_PER_WORD_MAX * max_words}


def _ids(live_ids: Sequence[str] | None, least: int, most: int | None) -> dict:
    schema: dict = {
        "type": "array",
        "items": {"type": "string"} if live_ids is None else {"enum": list(live_ids)},
        "minItems": least,
    }
    if most is not None:
        schema["maxItems"] = most
    return schema


def _case(kind: str, properties: dict, required: Sequence[str]) -> dict:
    return {
        "type": "object",
        "properties": {"op": {"const": kind}, **properties},
        "required": ["op", *required],
        "additionalProperties": False,
    }


def operations_schema(
    max_items: int | None = None,
    *,
    kinds: Sequence[str] = tuple(OP_KINDS),
    live_ids: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    min_words: int = 1,
    max_words: int = 64,
    pattern: str | None = None,
) -> dict:
    """The JSON schema of a reply: ``{"operations": [...]}``, each item one of the per-kind shapes below, so
    that constrained decoding cannot produce an add with ids, a modify without exactly one live id, a merge of
    fewer than two, an id that is not in the library, or a lesson outside the word bounds. Kinds that need ids
    are left out when the library has too few ids (``live_ids=None``: any ids, every kind). ``max_items``
    bounds the list (small models otherwise repeat operations until they run out of tokens); ``sources`` (group
    ids) bounds where an operation may say it came from; ``pattern`` (``learning.lesson_pattern``) is a regular
    expression every lesson must match."""
    text = _lesson_text(min_words, max_words, pattern)
    extra: dict = {"why": {"type": "string", "maxLength": 200}}  # short: a rambling reason eats the token budget
    if sources is not None:
        extra["sources"] = (
            {"type": "array", "items": {"enum": list(sources)}} if sources else {"type": "array", "maxItems": 0}
        )
    shapes = {
        "add": lambda: _case("add", {"text": text, **extra}, ["text"]),
        "modify": lambda: _case("modify", {"ids": _ids(live_ids, 1, 1), "text": text, **extra}, ["ids", "text"]),
        "merge": lambda: _case("merge", {"ids": _ids(live_ids, 2, None), "text": text, **extra}, ["ids", "text"]),
        "delete": lambda: _case("delete", {"ids": _ids(live_ids, 1, 1), **extra}, ["ids"]),
        "keep": lambda: _case("keep", {"ids": _ids(live_ids, 1, 1), **extra}, ["ids"]),
    }
    needs_ids = {"modify": 1, "delete": 1, "keep": 1, "merge": 2}
    n_ids = float("inf") if live_ids is None else len(live_ids)
    cases = [shapes[k]() for k in kinds if n_ids >= needs_ids.get(k, 0)]
    items: dict = {"type": "array", "items": {"anyOf": cases} if len(cases) > 1 else cases[0]}
    if max_items is not None:
        items["maxItems"] = max(1, max_items)
    return {
        "type": "object",
        "properties": {"operations": items},
        "required": ["operations"],
        "additionalProperties": False,
    }


OPERATIONS_SCHEMA: dict = operations_schema()  # every kind, any ids

DIFFERENCE_CHARS = 400  # of the "difference" a contrast reply names (a rambling one eats the token budget)


def contrast_schema(live_ids: Sequence[str] = (), *, min_words: int = 1, max_words: int = 64) -> dict:
    """A contrast reply: ``{"difference": ..., "lesson": ..., "revises": id or null}`` (``revises`` only when
    the library has lessons, and then only one of ``live_ids``)."""
    properties: dict = {
        "difference": {"type": "string", "maxLength": DIFFERENCE_CHARS},
        "lesson": _lesson_text(min_words, max_words, None),
    }
    if live_ids:
        properties["revises"] = {"anyOf": [{"type": "null"}, {"enum": list(live_ids)}]}
    return {
        "type": "object",
        "properties": properties,
        "required": ["difference", "lesson"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class LearnerPrompts:
    """The learner's wording for one domain. ``examples``: two concrete lessons of that domain, shown as the
    example reply (a small model copies whatever it is shown, so there are no placeholders to copy; a lesson
    copied from an example is rejected at apply time, see ``copied_from_prompt``). The prompts themselves are
    rendered by ``clgrpo.prompts`` from the ``LessonAsk`` that ``ask`` builds."""

    domain: str = "general"
    examples: tuple[str, str] = lessons.DEFAULT_EXAMPLES

    def ask(self, cfg: LearningConfig | None = None, **changes: Any) -> LessonAsk:
        """Every learner prompt's settings for a run: this domain's wording and ``cfg``'s rules (defaults: a
        ``LearningConfig()``'s), with ``changes`` to single fields (``min_words=5``, ...)."""
        cfg = cfg or LearningConfig()
        ask = LessonAsk(
            domain=self.domain,
            examples=self.examples,
            use_groundtruth=cfg.use_groundtruth,
            min_words=cfg.min_words,
            max_words=cfg.max_words,
            max_ops=cfg.max_ops_per_group,
        )
        return dataclasses.replace(ask, **changes)

    def copied_from_prompt(self, text: str) -> str | None:
        """A rejection reason when a lesson is mostly the prompts' own wording (an example lesson or the
        instructions) rather than something learned; None otherwise."""
        for example in self.examples:
            if overlap(text, example) >= COPY_OVERLAP:
                return f"copied from the prompt's example lesson: {example!r}"
        if overlap(text, _INSTRUCTION_TEXT) >= COPY_OVERLAP:
            return "copied from the prompt's instructions"
        return None


COPY_OVERLAP = 0.6  # share of a lesson's word trigrams found in the prompt's own wording
# the learner prompts' own wording, in this order: a lesson that mostly repeats it was copied, not learned
_INSTRUCTION_TEXT = " ".join(
    [
        extract.EXTRACT_SYSTEM,
        extract.EXTRACT_KINDS_MODIFY,
        extract.EXTRACT_USER,
        contrast.CONTRAST_SYSTEM,
        contrast.GENERALIZE,
        contrast.CONTRAST_REVISE_NOTE,
        contrast.CONTRAST_USER,
        consolidate.CONSOLIDATE_SYSTEM,
        consolidate.CONSOLIDATE_USER,
        lessons.EXAMPLE_BLOCK,
        repair.REPAIR,
        summarize.SUMMARIZE_SYSTEM,
        summarize.SUMMARIZE_GRADED,
        summarize.SUMMARIZE_UNGRADED,
    ]
)
_WORD_RE = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class LessonScreen:
    """What may not enter the library although the library's own rules (length, ids, duplicates) allow it: the
    learner prompt's own wording (an example lesson, the instructions), a copy of a training problem, a source
    problem's answer, a text that repeats itself (a looping generation), or a text that does not match
    ``learning.lesson_pattern``. Used as the library's
    ``screen``: a refused operation is rejected with the reason, and stored."""

    prompts: LearnerPrompts
    problems: Sequence[Problem] = ()
    pattern: str | None = None

    def __call__(self, op: Operation) -> str | None:
        text = op.text or ""
        if self.pattern and not re.fullmatch(self.pattern, text):
            return f"does not match learning.lesson_pattern {self.pattern!r}"
        copied = self.prompts.copied_from_prompt(text)
        if copied:
            return copied
        looped = repeated_phrase(text)
        if looped:
            return f"repeats itself: {looped!r} occurs more than once"
        for problem in self.problems:
            if overlap(text, problem.problem) >= COPY_OVERLAP or restates(text, problem.problem):
                return f"copied from training problem {problem.problem_id}"
        answers = {p.problem_id: p.answer for p in self.problems if p.answer}
        numbers = set(_NUMBER_RE.findall(text))
        for group in op.source_groups:
            answer = (answers.get(group) or "").strip()
            if len(answer) >= 2 and answer in numbers:
                return f"states the answer {answer} of problem {group}"
        for problem in (p for p in self.problems if p.problem_id in op.source_groups):
            if shared := problem_numbers(text, problem.problem):
                return (
                    f"names numbers of problem {problem.problem_id} ({', '.join(shared)}): a lesson must hold "
                    f"for every problem of its kind"
                )
        return None


def problem_numbers(text: str, problem: str) -> list[str]:
    """The numbers of ``problem`` that ``text`` repeats, when they make it about that problem: any number of two
    or more digits, or two or more one-digit numbers (a lone "1" in "add 1" is a rule, not the problem)."""
    mine = set(_NUMBER_RE.findall(problem))
    shared = sorted(n for n in set(_NUMBER_RE.findall(text)) & mine)
    long = [n for n in shared if len(n.lstrip("-").replace(".", "")) >= 2]
    return shared if long or len(shared) >= 2 else []


_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
_STOPWORDS = frozenset(
    "a an and are as at be by do does for from has have how if in into is it its of on or so than that the their "
    "them then there these they this to was were what when which who will with you your".split()
)
RESTATE_SHARE = 0.7  # share of a lesson's content words found in a problem: a restatement of that problem


def _content_words(text: str) -> list[str]:
    words = (_NUMBER_WORDS.get(w, w) for w in _WORD_RE.findall(text.casefold()))
    # single-letter variables (x, n) are notation, not content: a formula lesson is not a restated problem
    return [w for w in words if w not in _STOPWORDS and (len(w) > 1 or w.isdigit())]


LOOP_WORDS = 5  # a word sequence this long occurring twice in one lesson: the model looped


def repeated_phrase(text: str, size: int = LOOP_WORDS) -> str | None:
    """The first run of ``size`` words that occurs twice in ``text``, or None."""
    words = _WORD_RE.findall(text.casefold())
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - size + 1):
        gram = tuple(words[i : i + size])
        if gram in seen:
            return " ".join(gram)
        seen.add(gram)
    return None


def restates(text: str, source: str) -> bool:
    """Whether ``text`` mostly repeats the content words of ``source`` (numbers written out count as digits)."""
    words = _content_words(text)
    if len(words) < 4:
        return False
    known = set(_content_words(source))
    return sum(w in known for w in words) / len(words) >= RESTATE_SHARE


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _trigrams(text: str) -> set[tuple[str, ...]]:
    words = _WORD_RE.findall(text.casefold())
    return {tuple(words[i : i + 3]) for i in range(len(words) - 2)} or ({tuple(words)} if words else set())


SAME_LESSON = 0.8  # word-trigram overlap, both ways, at which two lesson texts say the same thing


def overlap(text: str, source: str) -> float:
    """The share of ``text``'s word trigrams that also occur in ``source`` (0 for an empty text)."""
    grams = _trigrams(text)
    return len(grams & _trigrams(source)) / len(grams) if grams else 0.0
