"""``clgrpo data make``: generated datasets (a seeded problem family as JSON lines)."""

from __future__ import annotations

import argparse

from application.commands.common import Command, CommandGroup
from clgrpo.inputs.config import ConfigError
from domains.math.synthetic import FAMILIES
from schemas.config import DatasetConfig


def cmd_data_make(args: argparse.Namespace) -> int:
    from domains.math.synthetic import generate_family, write_rows

    exclude: set[str] = set()
    for path in args.exclude or []:
        exclude |= {p.problem for p in _problems_of(path)}
    try:
        rows = generate_family(args.family, args.n, args.seed, exclude=exclude)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    out = write_rows(args.out, rows)
    kept_out = (
        f", none of the {len(exclude)} problems of {', '.join(args.exclude)} nor a near-duplicate" if exclude else ""
    )
    print(f"wrote {len(rows)} {args.family} problems (seed {args.seed}{kept_out}) to {out}")
    return 0


def _problems_of(path: str) -> list:
    from clgrpo.inputs.dataset import load_problems

    return load_problems(DatasetConfig(path=path, shuffle=False))


def make_arguments(make: argparse.ArgumentParser) -> None:
    make.add_argument("family", help=f"one of: {', '.join(FAMILIES)}")
    make.add_argument("--n", type=int, default=40, help="problems (default 40)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True, help="the .jsonl file to write")
    make.add_argument(
        "--exclude",
        action="append",
        metavar="FILE",
        help="leave out every problem of this dataset and its near-duplicates as the leakage guard measures them "
        "(e.g. the training set, for a held-out set)",
    )


DATA = CommandGroup(
    "data",
    "generated datasets",
    (Command("make", "write N problems of a seeded problem family as JSON lines", cmd_data_make, make_arguments),),
)
