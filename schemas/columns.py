"""What a record declares beside a field about the field's column (``schemas/tables.py`` derives the rest).

Kept apart from ``schemas.tables`` so that the records import neither pandas nor pandera: pydantic ignores these
markers; only the table's derivation reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sql:
    """The field's DuckDB type where its Python type does not say it (a seed is BIGINT, a vector FLOAT[])."""

    type: str


class Check:
    """Checks of the field's column that the record itself does not enforce, as pandera ``Field`` arguments
    (``ge``, ``isin``, ``unique``, ``str_length``...); they replace a check of the same name the record implies."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"Check({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


class PydanticJson:
    """A nested record stored as pydantic's own JSON text (``model_dump_json``), not ``json.dumps`` of it."""


NOT_EMPTY = Check(str_length={"min_value": 1})
NOT_NEGATIVE = Check(ge=0)
UNIQUE = Check(unique=True)  # within one written frame (a stage's rows)
SHARE = Check(ge=0.0, le=1.0)  # a mean reward, a probability, a proportion
DIFF = Check(ge=-1.0, le=1.0)  # a difference of two shares
LEVEL = Check(gt=0.0, lt=1.0)  # a confidence level
