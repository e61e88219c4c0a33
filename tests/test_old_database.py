"""A database written by an earlier version (``tests/data/old_run``: a run whose first step completed and whose
second failed) opens with the code as it is now, with the schema a new file gets, and its run resumes: the same
fingerprint, the first step read back (its problems never asked again), the second done; stored before model
identities existed, the run is bound to the policy it resumed with (docs/reliability.md)."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from flows.train import train
from tests.data.old_run.world import FIRST_STEP, SECOND_STEP, config, world

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]

FIXTURE = Path(__file__).resolve().parent / "data" / "old_run"


def schema(store: Store) -> list[tuple]:
    return [
        tuple(row)
        for row in store.query(
            "SELECT table_name, column_index, column_name, data_type, is_nullable, column_default "
            "FROM duckdb_columns() WHERE database_name = current_database() ORDER BY ALL"
        ).itertuples(index=False)
    ]


@pytest.fixture
def old_run(tmp_path, monkeypatch) -> Path:
    """A copy of the old run's folder, the current directory (its config's paths are relative)."""
    with gzip.open(FIXTURE / "old_run.duckdb.gz") as packed, open(tmp_path / "old_run.duckdb", "wb") as db:
        shutil.copyfileobj(packed, db)
    shutil.copy(FIXTURE / "train.jsonl", tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def test_an_old_database_resumes_where_it_stopped(old_run, tmp_path_factory):
    with Store("old_run.duckdb") as store:
        fingerprint = store.query("SELECT fingerprint FROM runs WHERE run_id = 'old-run'")["fingerprint"].tolist()
        assert store.steps_done("old-run") == 1
        old_schema = schema(store)
    with Store(tmp_path_factory.mktemp("fresh") / "new.duckdb") as fresh:
        assert old_schema == schema(fresh), "an old file, once opened, has the schema a new file gets"
    scripted = world(down=[])
    with FakeOpenAIServer(scripted) as server:
        await train(config(server.base_url))
    assert scripted.asked == {p["problem"] for p in SECOND_STEP}
    assert not scripted.asked & {p["problem"] for p in FIRST_STEP}
    with Store("old_run.duckdb", read_only=True) as store:
        assert store.query("SELECT fingerprint, status FROM runs").values.tolist() == [[*fingerprint, "completed"]]
        assert store.steps_done("old-run") == 2
        bound = store.run_identity("old-run")  # stored before identities existed: bound to the model it resumed with
    assert bound is not None and bound.model == "scripted" and bound.key is None  # its endpoint states nothing more
