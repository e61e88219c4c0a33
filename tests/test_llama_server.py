"""clgrpo/app/llama_server.py: finding the binary, the command line, start (wait for /health), stop, failures, and
the server dying with the process that started it. A stand-in executable plays llama-server (a real process
serving /health over HTTP); building the real one takes minutes and is exercised by `clgrpo demo`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clgrpo.app import llama_server
from clgrpo.app.llama_server import BINARY_ENV, LlamaServer, ServerError, find_binary

STAND_IN = textwrap.dedent('''\
    #!{python}
    """Plays llama-server: parses --port, loads for a moment, then answers /health with status ok."""
    import http.server, json, sys, time
    args = sys.argv[1:]
    if "--fail" in args:
        print("error: failed to load model", flush=True)
        sys.exit(1)
    port = int(args[args.index("--port") + 1])
    print("argv", json.dumps(args), flush=True)
    time.sleep(0.5)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({{"status": "ok"}}).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(STAND_IN.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setenv(BINARY_ENV, str(binary))
    return binary


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_the_binary_comes_from_the_env_else_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(BINARY_ENV, raising=False)
    assert find_binary(tmp_path) is None
    built = llama_server.binary_path(tmp_path)
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert find_binary(tmp_path) == built
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(ServerError, match=f"{BINARY_ENV}=.*missing: no such file"):
        find_binary(tmp_path)


def test_not_built_is_one_clear_error(tmp_path, monkeypatch, gguf):
    monkeypatch.delenv(BINARY_ENV, raising=False)
    with pytest.raises(ServerError, match="clgrpo model build-server"):
        LlamaServer(gguf, "m", cache=tmp_path).start()


def test_start_waits_for_health_and_stop_ends_the_process(stand_in, gguf, tmp_path):
    with LlamaServer(gguf, "qwen", slots=3, threads=1, log_path=tmp_path / "server.log") as server:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1" and server.process.poll() is None
        argv = server.command(stand_in)
        assert argv[argv.index("--alias") + 1] == "qwen" and argv[argv.index("--parallel") + 1] == "3"
        assert argv[argv.index("--ctx-size") + 1] == str(3 * server.context_per_slot)
        process = server.process
    assert process.poll() is not None  # stopped on exit
    assert '"--model"' in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_while_loading_says_so_with_its_log(stand_in, gguf, tmp_path):
    server = LlamaServer(gguf, "m", extra_args=["--fail"], log_path=tmp_path / "s.log")
    with pytest.raises(ServerError, match="exited with 1 while loading m.gguf: error: failed to load model"):
        server.start()


def test_a_missing_model_file_is_named(stand_in, tmp_path):
    with pytest.raises(Exception, match="GGUF file not found: .*absent.gguf"):
        LlamaServer(tmp_path / "absent.gguf", "m").start()


def test_the_server_dies_with_the_process_that_started_it(stand_in, gguf, tmp_path):
    """SIGKILL the parent (no chance to clean up): the server gets SIGTERM from the kernel and ends."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from clgrpo.app.llama_server import LlamaServer
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
