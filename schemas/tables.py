"""A DuckDB table, declared once: its record (``schemas.records``) and how the record becomes rows.

A ``Table`` derives from its record everything the store needs: the columns (a field is a column of its name; a
list, dict or nested record is JSON text in ``<name>_json``), their DuckDB types (``str`` VARCHAR, ``int``
INTEGER, ``float`` DOUBLE, ``bool`` BOOLEAN, ``datetime`` TIMESTAMPTZ; another type is declared beside the field
with ``Sql``), NULL (a field that may be None, and every column a migration added: older rows hold NULL there),
the pandera frame that validates each written frame (the field's pydantic constraints, its ``Literal`` or enum
choices, and the checks declared beside it with ``Check`` that the record itself does not enforce), and the
mappers between records and rows. Stage tables carry (run_id, step, stage) before the record's columns: the store
replaces a stage's rows by that key, so re-writing a stage never duplicates.

A column added after a table was first released is a migration of the table (``added``), in the order they were
added: a file created before gets it when it is opened. Existing tables and columns are a user-visible contract:
add, never rename or drop. The tables of this project are declared in ``schemas/catalog.py``; a table declared
elsewhere (a stage added from outside) is created by every store opened after its declaration.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from schemas.columns import NOT_EMPTY, NOT_NEGATIVE, Check, PydanticJson, Sql


# --- migrations ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddColumns:
    """Columns added after the table's first release, in this order (NULL in the rows written before)."""

    columns: tuple[str, ...]


@dataclass(frozen=True)
class DropNotNull:
    """NOT NULL constraints lifted after the table's first release."""

    columns: tuple[str, ...]


def added(*columns: str) -> AddColumns:
    return AddColumns(columns)


def not_null_dropped(*columns: str) -> DropNotNull:
    return DropNotNull(columns)


Migration = AddColumns | DropNotNull


# --- columns ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Computed:
    """A column no field holds: its value from the record and its position in the write (``value``), placed
    right after the column ``after`` (None: first after the key)."""

    name: str
    annotation: Any
    value: Callable[[Any, int], Any]
    after: str | None = None


@dataclass(frozen=True)
class Column:
    name: str
    sql: str
    nullable: bool
    checks: dict[str, Any]
    field: str | None = None  # the record's field it holds (None: a key column or a computed one)
    parent: str | None = None  # the nested record's field it is in (a flattened field)
    json: Literal["", "json", "pydantic"] = ""
    computed: Computed | None = None

    @property
    def frame_type(self) -> Any:
        if self.sql in ("INTEGER", "BIGINT"):
            return pd.Int64Dtype if self.nullable else int
        return {
            "VARCHAR": str,
            "DOUBLE": float,
            "BOOLEAN": bool,
            "TIMESTAMPTZ": pd.DatetimeTZDtype,
            "FLOAT[]": object,
        }[self.sql]

    def frame_field(self) -> Any:
        kwargs = dict(self.checks)
        if self.nullable:
            kwargs["nullable"] = True
        if self.sql == "TIMESTAMPTZ":
            kwargs["dtype_kwargs"] = {"unit": "us", "tz": "UTC"}
        return pa.Field(**kwargs)

    def ddl(self) -> str:
        return f"{self.name} {self.sql}" + ("" if self.nullable else " NOT NULL")


_SQL_TYPES: dict[Any, str] = {str: "VARCHAR", int: "INTEGER", float: "DOUBLE", bool: "BOOLEAN", datetime: "TIMESTAMPTZ"}


def _unwrapped(annotation: Any) -> tuple[Any, bool, list[Any]]:
    """The annotation without ``Annotated`` and ``None``: (type, whether None is allowed, metadata)."""
    metadata: list[Any] = []
    if get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        metadata.extend(extra)
    optional = False
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        annotation = args[0] if len(args) == 1 else typing.Union[tuple(args)]
    if get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        metadata.extend(extra)
    return annotation, optional, metadata


def _is_nested(base: Any) -> bool:
    return (
        get_origin(base) in (list, dict)
        or base in (list, dict)
        or (isinstance(base, type) and issubclass(base, BaseModel))
    )


def _checks(base: Any, metadata: Iterable[Any]) -> dict[str, Any]:
    """pandera ``Field`` arguments from the field's constraints, choices and declared ``Check``s."""
    checks: dict[str, Any] = {}
    if get_origin(base) is Literal:
        checks["isin"] = list(get_args(base))
    elif isinstance(base, type) and issubclass(base, StrEnum):
        checks["isin"] = [member.value for member in base]
    declared: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            checks["ge"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            checks["gt"] = item.gt
        elif isinstance(item, annotated_types.Le):
            checks["le"] = item.le
        elif isinstance(item, annotated_types.Lt):
            checks["lt"] = item.lt
        elif isinstance(item, annotated_types.MinLen):
            checks["str_length"] = {"min_value": item.min_length}
        elif getattr(item, "pattern", None) is not None:
            checks["str_matches"] = item.pattern
        elif isinstance(item, Check):
            declared.update(item.kwargs)
    return {**checks, **declared}


def column_of(name: str, annotation: Any, metadata: Sequence[Any] = (), **where: Any) -> Column:
    """The column a field (or a key or computed column) of this annotation is stored in."""
    base, optional, more = _unwrapped(annotation)
    metadata = [*metadata, *more]
    sql = next((item.type for item in metadata if isinstance(item, Sql)), None)
    json_kind: Literal["", "json", "pydantic"] = ""
    if sql is None and _is_nested(base):
        sql, name = "VARCHAR", f"{name}_json"
        json_kind = "pydantic" if any(isinstance(item, PydanticJson) for item in metadata) else "json"
    if sql is None:
        literal = get_origin(base) is Literal or (isinstance(base, type) and issubclass(base, StrEnum))
        sql = "VARCHAR" if literal else _SQL_TYPES[base]
    return Column(name, sql, optional, _checks(base, metadata), json=json_kind, **where)


def _field_column(name: str, info: FieldInfo, **where: Any) -> Column:
    return column_of(name, info.annotation, info.metadata, field=name, **where)


def _dumps(value: Any) -> str:
    return json.dumps(to_jsonable_python(value), ensure_ascii=False)


def _encoded(column: Column, value: Any) -> Any:
    if column.json == "pydantic":
        return value.model_dump_json()
    if column.json:
        return _dumps(value)
    return value.value if isinstance(value, StrEnum) else value


def _decoded(column: Column, value: Any) -> Any:
    return json.loads(value) if column.json and value is not None else value


# --- whole-frame checks (a plain function of the frame; a failure names the function) ----------------------------
def unique_rows(name: str, *columns: str, doc: str | None = None) -> Callable[[pd.DataFrame], bool]:
    """A frame check: no two rows share these columns' values."""

    def check(df: pd.DataFrame) -> bool:
        return not df.duplicated(list(columns)).any()

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


# --- the table ----------------------------------------------------------------------------------------------------
STAGE_KEY = ("run_id", "step", "stage")
STAGE_KEYED: dict[str, Any] = {
    "run_id": Annotated[str, NOT_EMPTY],
    "step": Annotated[int, NOT_NEGATIVE],
    "stage": Annotated[str, NOT_EMPTY],
}


class _Frame(pa.DataFrameModel):
    class Config:
        coerce = True
        strict = True


@dataclass
class Table:
    """One DuckDB table and the record its rows hold (see the module docstring).

    ``key``: the columns before the record's, which the store fills (name -> annotation; the stage key by
    default); a field named like a key column is that column. ``first``: fields placed right after the key (the
    row's role, e.g. a sample's condition). ``computed``: columns no field holds. ``flatten``: nested records
    whose fields are columns of their own. ``rename``: field -> column. ``skip``: fields never stored.
    ``primary_key``: DuckDB's key (none for a stage table: the store replaces its rows by the stage key).
    ``migrations``: in the order they were made. ``checks``: whole-frame checks. ``order``: how a stage's rows
    are read back (``ORDER BY step, <order>``)."""

    name: str
    record: type[BaseModel]
    key: dict[str, Any] = field(default_factory=lambda: dict(STAGE_KEYED))
    first: tuple[str, ...] = ()
    computed: tuple[Computed, ...] = ()
    flatten: tuple[str, ...] = ()
    rename: dict[str, str] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    primary_key: tuple[str, ...] = ()
    migrations: tuple[Migration, ...] = ()
    checks: tuple[Callable[[pd.DataFrame], Any], ...] = ()
    order: str = "1"
    by_stage: bool = True  # a stage-keyed table that Store.write_stage writes (not the store's own marker)
    columns: tuple[Column, ...] = field(init=False)
    frame: type[pa.DataFrameModel] = field(init=False)  # validates every frame written to the table
    _by_field: dict[tuple[str | None, str], Column] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.columns = self._columns()
        self.frame = self._frame()
        self._by_field = {(c.parent, c.field): c for c in self.columns if c.field is not None}
        for name in self.key:  # a field named like a key column (a call's stage) reads that column
            if name in self.record.model_fields:
                self._by_field[(None, name)] = column_of(name, self.key[name], field=name)

    # --- columns
    def _record_columns(self) -> list[Column]:
        columns: list[Column] = []
        for name, info in self.record.model_fields.items():
            if name in self.skip or name in self.key:
                continue
            if name in self.flatten:
                nested = _unwrapped(info.annotation)[0]
                columns += [_field_column(n, i, parent=name) for n, i in nested.model_fields.items()]
                continue
            column = _field_column(name, info)
            if name in self.rename:
                column = replace(column, name=self.rename[name])
            columns.append(column)
        for extra in self.computed:
            column = column_of(extra.name, extra.annotation, computed=extra)
            where = 0 if extra.after is None else 1 + [c.name for c in columns].index(extra.after)
            columns.insert(where, column)
        return columns

    def _columns(self) -> tuple[Column, ...]:
        key = [column_of(name, annotation) for name, annotation in self.key.items()]
        own = self._record_columns()
        later = [name for m in self.migrations if isinstance(m, AddColumns) for name in m.columns]
        by_name = {c.name: c for c in own}
        unknown = [name for name in [*self.first, *later] if name not in by_name]
        if unknown:
            raise ValueError(f"table {self.name}: no column {unknown} in its record {self.record.__name__}")
        ordered = [
            *(by_name[n] for n in self.first),
            *(c for c in own if c.name not in self.first and c.name not in later),
            *(replace(by_name[n], nullable=True) for n in dict.fromkeys(later)),
        ]
        return (*key, *ordered)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def stage_keyed(self) -> bool:
        return tuple(self.key) == STAGE_KEY

    # --- DDL
    def create_statement(self) -> str:
        lines = [column.ddl() for column in self.columns]
        if self.primary_key:
            lines.append(f"PRIMARY KEY ({', '.join(self.primary_key)})")
        body = ",\n    ".join(lines)
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n    {body}\n)"

    def migration_statements(self) -> list[str]:
        types_ = {c.name: c.sql for c in self.columns}
        statements = []
        for migration in self.migrations:
            if isinstance(migration, AddColumns):
                statements += [
                    f"ALTER TABLE {self.name} ADD COLUMN IF NOT EXISTS {name} {types_[name]}"
                    for name in migration.columns
                ]
            else:
                statements += [f"ALTER TABLE {self.name} ALTER COLUMN {c} DROP NOT NULL" for c in migration.columns]
        return statements

    # --- the frame
    def _frame(self) -> type[pa.DataFrameModel]:
        namespace: dict[str, Any] = {"__annotations__": {}, "__module__": __name__}
        for column in self.columns:
            namespace["__annotations__"][column.name] = Series.__class_getitem__(column.frame_type)
            namespace[column.name] = column.frame_field()
        for check in self.checks:
            namespace[check.__name__] = pa.dataframe_check(_as_classmethod(check))
        title = "".join(part.title() for part in self.name.split("_")) + "Frame"
        return type(title, (_Frame,), namespace)

    # --- records <-> rows
    def rows(self, records: Sequence[Any]) -> list[dict[str, Any]]:
        """The rows of these records (without the key's columns, which the store adds)."""
        own = self.columns[len(self.key) :]
        out = []
        for position, record in enumerate(records):
            row: dict[str, Any] = {}
            for column in own:
                if column.computed is not None:
                    row[column.name] = column.computed.value(record, position)
                    continue
                holder = getattr(record, column.parent) if column.parent else record
                row[column.name] = _encoded(column, getattr(holder, column.field or column.name))
            out.append(row)
        return out

    def record_of(self, row: dict[str, Any]) -> Any:
        """The record a row holds (a NULL in a column added after the row was written: the field's default)."""
        values = _values(self.record, row, self._by_field, None)
        for name in self.flatten:
            nested = _unwrapped(self.record.model_fields[name].annotation)[0]
            values[name] = nested(**_values(nested, row, self._by_field, name))
        return self.record(**values)


def _values(
    model: type[BaseModel], row: dict[str, Any], by_field: dict[tuple[str | None, str], Column], parent: str | None
) -> dict[str, Any]:
    values = {}
    for name, info in model.model_fields.items():
        column = by_field.get((parent, name))
        if column is None or column.name not in row:
            continue
        value = _decoded(column, row[column.name])
        if value is None and info.default is not None and not info.is_required():
            continue
        values[name] = value
    return values


def _as_classmethod(check: Callable[[pd.DataFrame], Any]) -> Any:
    def method(cls: Any, df: pd.DataFrame) -> Any:
        return check(df)

    method.__name__ = method.__qualname__ = check.__name__
    method.__doc__ = check.__doc__
    return classmethod(method)


# --- the tables a store creates -----------------------------------------------------------------------------------
TABLES: dict[str, Table] = {}


def declare(table: Table) -> Table:
    """Add a table to those every store creates (declared again under the same name: replaced)."""
    TABLES[table.name] = table
    return table


def table_of(record: type) -> str:
    """The one table whose record is ``record`` (this very class, not a subclass): how a typed read or write
    names its table. A record no table holds, or one that two tables hold, is a ``TypeError``: name such a
    table itself."""
    names = [name for name, table in TABLES.items() if table.record is record]
    if len(names) != 1:
        held = f"is the record of {len(names)} tables ({', '.join(names)})" if names else "is the record of no table"
        raise TypeError(f"{getattr(record, '__qualname__', record)} {held}: name the table instead")
    return names[0]


def create_statements() -> list[str]:
    tables = [table.create_statement() for table in TABLES.values()]
    return tables + [statement for table in TABLES.values() for statement in table.migration_statements()]


def run_tables() -> tuple[str, ...]:
    """Tables with a run_id column: everything ``Store.delete_run`` removes, in the order declared."""
    return tuple(name for name, table in TABLES.items() if "run_id" in table.column_names)


def stage_tables() -> tuple[str, ...]:
    """Tables written through ``Store.write_stage``, replaced as a unit by (run_id, step, stage)."""
    return tuple(name for name, table in TABLES.items() if table.stage_keyed and table.by_stage)
