"""application/llama_server.py and llama_build.py: finding the engine, the command line, start (wait for /health),
stop, crashes in words, the smoke test that decides whether a machine can trust an engine (and what it needs),
the build's kernel choice and its lock, and the server dying with the process that started it. A stand-in
executable plays llama-server (a real process serving /health and a chat completion over HTTP, or dying by
SIGSEGV at load); building the real one takes minutes and is exercised by `clgrpo demo`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from application import llama_build
from application.llama_server import (
    BINARY_ENV,
    LlamaEngine,
    LlamaServer,
    ServerCrashed,
    ServerError,
    ensure_engine,
    find_engine,
)

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = textwrap.dedent("""\
    #!{python}
    # Plays llama-server: parses --port, loads for a moment, then answers /health and one chat completion.
    # $STAND_IN_CRASH: "always" dies by SIGSEGV while loading, "unless-no-repack" too unless --no-repack is given
    import http.server, json, os, signal, sys, time
    args = sys.argv[1:]
    if "--fail" in args:
        print("error: failed to load model", flush=True)
        sys.exit(1)
    crash = os.environ.get("STAND_IN_CRASH", "never")
    print("argv", json.dumps(args), flush=True)
    if crash == "always" or (crash == "unless-no-repack" and "--no-repack" not in args):
        print("load_tensors: repacking weights", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    port = int(args[args.index("--port") + 1])
    time.sleep(0.5)

    class Server(http.server.BaseHTTPRequestHandler):
        def reply(self, status, payload):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200 if self.path == "/health" else 404, {{"status": "ok"}})

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.reply(200, {{"choices": [{{"message": {{"role": "assistant", "content": "OK"}}}}]}})

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Server).serve_forever()
""")


def write_stand_in(path: Path) -> Path:
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    binary = write_stand_in(tmp_path / "llama-server")
    monkeypatch.setenv(BINARY_ENV, str(binary))
    monkeypatch.delenv("STAND_IN_CRASH", raising=False)
    return binary


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def fake_build(cache: Path) -> Path:
    """A finished build in the cache, as ``build_engine`` leaves it (the binary a stand-in)."""
    folder = llama_build.engine_dir(cache)
    folder.mkdir(parents=True)
    write_stand_in(folder / "llama-server")
    (folder / "build.json").write_text('{"variants": ["x64"]}')
    return folder / "llama-server"


def test_the_engine_comes_from_the_env_else_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(BINARY_ENV, raising=False)
    assert find_engine(tmp_path) is None
    llama_build.engine_dir(tmp_path).mkdir(parents=True)
    (llama_build.engine_dir(tmp_path) / "llama-server").write_text("")
    assert find_engine(tmp_path) is None  # no build.json: an unfinished build is not an engine
    (llama_build.engine_dir(tmp_path) / "build.json").write_text("{}")
    assert find_engine(tmp_path) == LlamaEngine(llama_build.engine_dir(tmp_path) / "llama-server")
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(ServerError, match=f"{BINARY_ENV}=.*missing: no such file"):
        find_engine(tmp_path)


def test_not_built_is_one_clear_error(tmp_path, monkeypatch, gguf):
    monkeypatch.delenv(BINARY_ENV, raising=False)
    with pytest.raises(ServerError, match="clgrpo model build-server"):
        LlamaServer(gguf, "m", cache=tmp_path).start()
    with pytest.raises(ServerError, match="clgrpo model build-server"):
        ensure_engine(tmp_path, build=False)


def test_start_waits_for_health_and_stop_ends_the_process(stand_in, gguf, tmp_path):
    with LlamaServer(gguf, "qwen", slots=3, threads=1, log_path=tmp_path / "server.log") as server:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1" and server.process.poll() is None
        argv = server.command(LlamaEngine(stand_in, ("--no-repack",)))
        assert argv[argv.index("--alias") + 1] == "qwen" and argv[argv.index("--parallel") + 1] == "3"
        assert argv[argv.index("--ctx-size") + 1] == str(3 * server.context_per_slot) and "--no-repack" in argv
        assert server.complete("hi") == "OK"
        process = server.process
    assert process.poll() is not None  # stopped on exit
    assert '"--model"' in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_while_loading_says_so_with_its_log(stand_in, gguf, tmp_path):
    server = LlamaServer(gguf, "m", extra_args=["--fail"], log_path=tmp_path / "s.log")
    with pytest.raises(ServerError, match="exited with code 1 while loading m.gguf: error: failed to load model"):
        server.start()


def test_a_crash_at_load_is_said_in_words(stand_in, gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_CRASH", "always")
    with pytest.raises(ServerCrashed) as caught:
        LlamaServer(gguf, "m", log_path=tmp_path / "s.log").start()
    assert str(caught.value) == (
        "llama-server crashed (SIGSEGV, a segmentation fault) while loading m.gguf: load_tensors: repacking "
        f"weights (log: {tmp_path / 's.log'})"
    )


def test_a_crash_while_serving_is_noticed(stand_in, gguf, tmp_path):
    server = LlamaServer(gguf, "m", log_path=tmp_path / "s.log").start()
    try:
        assert server.died() is None
        server.process.send_signal(signal.SIGSEGV)
        server.process.wait(5)
        assert str(server.died()).startswith(
            "llama-server crashed (SIGSEGV, a segmentation fault) while serving m.gguf"
        )
    finally:
        server.stop()


def test_a_missing_model_file_is_named(stand_in, tmp_path):
    with pytest.raises(Exception, match="GGUF file not found: .*absent.gguf"):
        LlamaServer(tmp_path / "absent.gguf", "m").start()


# --- trusting an engine on this machine ---------------------------------------------------------------------
def test_the_smoke_test_runs_once_per_machine_and_keeps_what_worked(tmp_path, gguf, monkeypatch):
    """A build whose kernels fault at load (the AMX Xeon) works with --no-repack: found once, then used."""
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("STAND_IN_CRASH", "unless-no-repack")
    binary = fake_build(tmp_path)
    lines: list[str] = []
    engine = ensure_engine(tmp_path, log=lines.append, smoke_model=gguf)
    assert engine == LlamaEngine(binary, ("--no-repack",))
    assert lines[-1].startswith("llama-server works on this machine with --no-repack (as built it failed: llama-")
    assert "crashed (SIGSEGV" in lines[-1]
    lines.clear()
    assert ensure_engine(tmp_path, log=lines.append, smoke_model=gguf) == engine and lines == []  # kept
    assert find_engine(tmp_path) == engine
    with LlamaServer(gguf, "m", cache=tmp_path, log_path=tmp_path / "s.log") as server:  # used with what worked
        assert server.complete("hi") == "OK"


def test_an_engine_that_fails_here_is_refused_and_not_tried_again(tmp_path, gguf, monkeypatch):
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("STAND_IN_CRASH", "always")
    fake_build(tmp_path)
    with pytest.raises(ServerError, match=r"does not work on this machine: llama-server crashed \(SIGSEGV"):
        ensure_engine(tmp_path, log=lambda m: None, smoke_model=gguf)
    monkeypatch.setenv("STAND_IN_CRASH", "never")  # it would work now, but it is not tried again
    with pytest.raises(ServerError, match="does not work on this machine.*build-server --force"):
        find_engine(tmp_path)


def test_the_build_uses_portable_kernels_and_never_amx():
    amx_xeon = frozenset(
        "sse4_2 avx f16c fma avx2 bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni "
        "avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16".split()
    )
    assert llama_build.kernel_variants(amx_xeon) == ["x64", "haswell", "zen4"]
    assert llama_build.kernel_variants(frozenset("sse4_2 avx f16c fma avx2 bmi2".split())) == ["x64", "haswell"]
    assert llama_build.kernel_variants(frozenset({"sse2"})) == ["x64", "haswell"]  # built; ggml loads x64 there
    assert "-DGGML_NATIVE=OFF" in llama_build.COMMON_OPTIONS and "-DGGML_BACKEND_DL=ON" in llama_build.COMMON_OPTIONS


def test_a_second_build_waits_for_the_first(tmp_path):
    """Two processes building into one cache: the second waits for the lock, saying so, then finds the build."""
    script = textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from application import llama_build
        with llama_build.build_lock({str(tmp_path)!r}, print):
            print("holding", flush=True)
            time.sleep(3)
    """)
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "holding"
        lines: list[str] = []
        started = time.monotonic()
        with llama_build.build_lock(tmp_path, lines.append, every_s=1.0):
            waited = time.monotonic() - started
        assert 1.5 < waited < 30
        assert lines[0].startswith(f"building llama-server into {tmp_path / 'bin'} (log: ")
        assert f"another clgrpo process (pid {first.pid}, since " in lines[0] and lines[0].endswith("waiting for it")
        assert any("still waiting for the other process after" in line for line in lines[1:])
    finally:
        first.kill()
        first.wait()
        first.stdout.close()


def test_the_server_dies_with_the_process_that_started_it(stand_in, gguf, tmp_path):
    """SIGKILL the parent (no chance to clean up): the server gets SIGTERM from the kernel and ends."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from application.llama_server import LlamaServer
        server = LlamaServer({str(gguf)!r}, "m", log_path={str(tmp_path / "p.log")!r}).start()
        print(server.process.pid, flush=True)
        time.sleep(600)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env={**os.environ})
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_model_serve_says_a_crash_in_one_line(tmp_path, gguf):
    """`clgrpo model serve` as a user runs it, the engine crashing by SIGSEGV while it loads the model: one line in
    words, no traceback, exit 1. (This machine's smoke test of the stand-in is recorded as passed: the real test
    loads the tiny model, which is not fetched here.)"""
    from application import llama_server

    binary = write_stand_in(tmp_path / "llama-server")
    cache = tmp_path / "cache"
    llama_server._remember(cache, llama_server._trust_key(LlamaEngine(binary)), {"ok": True, "args": []})
    env = {**os.environ, BINARY_ENV: str(binary), "STAND_IN_CRASH": "always", "CLGRPO_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "application.cli", "model", "serve", str(gguf), "--port", str(llama_server.free_port())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "error: llama-server crashed (SIGSEGV, a segmentation fault) while loading m.gguf: load_tensors: repacking "
        "weights (log: "
    ), lines
