"""Shared test setup: an isolated Prefect home and one Prefect test harness per session (started lazily,
only by tests that run flows)."""

import atexit
import os
import shutil
import tempfile

import pytest

# one temporary folder per test session for what must not touch the user's own: removed when the session ends
_SESSION_DIR = tempfile.mkdtemp(prefix="clgrpo-tests-")
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_DIR, "prefect"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# flows would freeze the test session's objects (clgrpo/process/runtime.py)
os.environ.setdefault("CLGRPO_TUNE_GC", "0")
os.environ["CLGRPO_STATE_DIR"] = os.path.join(_SESSION_DIR, "state")  # never the user's recent databases


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    from application.prefect_server import install

    install()  # the harness's server dies with this process, even a SIGKILLed one
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One real ``prefect server`` for the session, for tests whose CLI subprocesses (and workers) talk to it
    through PREFECT_API_URL."""
    from tests.processes import real_prefect_server

    yield from real_prefect_server(tmp_path_factory.mktemp("prefect-server"))
