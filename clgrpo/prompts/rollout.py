"""The layout every domain's rollout prompt shares (the solver's user message).

Everything problem-independent comes first: the system message (the domain's, with the answer format and
``DATA_NOTICE``), then the experience library at the start of the user message, so that every rollout of a step
shares one long identical prefix which servers can cache; only the problem text at the very end differs
(benchmarks/prefix.py measures the shared share: >= 90% of prompt tokens with a 30-experience library on AIME
problems). The problem is data, not instructions: it is quoted inside ``<problem>`` (the library inside
``<library>``) with ``quoting.quote``.
"""

from __future__ import annotations

from clgrpo.prompts import quoting

LIBRARY_TEMPLATE = "Experiences learned from earlier attempts (read them and apply the ones that fit):\n{library}\n\n"

PROBLEM_TEMPLATE = "Problem:\n{problem}"  # last: the only problem-specific text (then its closing tag)


def rollout_user_text(problem_text: str, library_text: str) -> str:
    library = library_text.strip()
    prefix = LIBRARY_TEMPLATE.format(library=quoting.quote("library", library)) if library else ""
    return prefix + PROBLEM_TEMPLATE.format(problem=quoting.quote("problem", problem_text))
