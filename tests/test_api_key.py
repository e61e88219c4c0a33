"""Where an endpoint's API key comes from: the configured environment variable, else a Prefect Secret block,
which must also load where backends are made: inside an event loop."""

import asyncio

import pytest

from clgrpo.models.api_keys import resolve_api_key
from schemas.config import ModelConfig

BLOCK = "clgrpo-test-api-key"
ENV = "CLGRPO_TEST_API_KEY"


def test_the_environment_variable_comes_first(monkeypatch):
    monkeypatch.setenv(ENV, "sk-from-env")
    assert resolve_api_key(ModelConfig(model="m", api_key_env=ENV, api_key_secret_block=BLOCK)) == "sk-from-env"


def test_no_variable_and_no_block_is_no_key(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_api_key(ModelConfig(model="m", api_key_env=ENV)) is None


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_a_secret_block_is_read_outside_and_inside_an_event_loop(monkeypatch):
    from prefect.blocks.system import Secret

    Secret(value="sk-from-block").save(BLOCK, overwrite=True)
    monkeypatch.delenv(ENV, raising=False)
    cfg = ModelConfig(model="m", api_key_env=ENV, api_key_secret_block=BLOCK)

    async def in_a_loop() -> str | None:
        return resolve_api_key(cfg)

    assert resolve_api_key(cfg) == "sk-from-block"
    assert asyncio.run(in_a_loop()) == "sk-from-block"
