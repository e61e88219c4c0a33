"""Embedding cost and retrieval latency for the lesson library.

1. Embedding: the embedded all-MiniLM-L6-v2 (``clgrpo.models.embeddings``, CPU, fp32) on 1,000 lesson-like texts: the
   27 lessons of ``tests/data/reference_library_math.json``, each cut or extended to a random length (10-40
   words) and mixed with clauses of other lessons (seeded, so every run embeds the same texts). Seconds per
   1,000 texts for each batch size and torch thread count, best and median of ``--repeats`` runs after one
   warm-up; the model load time is reported once.
2. Retrieval: ``nearest`` top-k over 100 / 1,000 / 10,000 random unit vectors of 384 dimensions (what the
   library's lessons would be), one query at a time and 100 queries at once (``normalized=True``: stored rows
   are unit length already; and ``normalized=False`` once, the cost of re-normalising).
3. Routing: ``clgrpo.experience.retrieval.select_experiences`` for a step of 100 problems (``library.injection: top_k``)
   over the same library sizes, vectors already stored: the per-step cost of retrieval injection.

    python benchmarks/embeddings.py [--threads 1,2] [--batch-sizes 32,64] [--repeats 3] [--json out.json]

The model must be fetched first (``python -m clgrpo.models.embeddings fetch``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from clgrpo.models.embeddings import EmbeddingConfig, EmbeddingError, make_embedder, nearest, normalize_rows  # noqa: E402

LESSONS = ROOT / "tests" / "data" / "reference_library_math.json"


def lesson_texts(n: int = 1000, seed: int = 0) -> list[str]:
    lessons = list(json.loads(LESSONS.read_text()).values())
    words = [lesson.split() for lesson in lessons]
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        base = list(words[i % len(words)])
        target = rng.randint(10, 40)
        while len(base) < target:
            other = rng.choice(words)
            start = rng.randrange(len(other))
            base += other[start : start + rng.randint(4, 12)]
        texts.append(" ".join(base[:target]))
    return texts


def bench_embedding(threads: list[int], batch_sizes: list[int], repeats: int) -> tuple[list[dict], float, dict]:
    import torch

    texts = lesson_texts()
    lengths = [len(t.split()) for t in texts]
    t0 = time.perf_counter()
    embedder = make_embedder(EmbeddingConfig(backend="embedded", cpu_threads=max(threads)))
    embedder.load()
    load_s = time.perf_counter() - t0
    tokens = [len(embedder.load().tokenizer(t)["input_ids"]) for t in texts]
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)  # process-wide, as the embedder sets it at load
        for batch in batch_sizes:
            embedder.batch_size = batch
            asyncio.run(embedder.embed(texts[:batch]))  # warm-up
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                vecs = asyncio.run(embedder.embed(texts))
                times.append(time.perf_counter() - t)
            assert vecs.shape == (len(texts), 384)
            rows.append(
                {
                    "threads": n_threads,
                    "batch_size": batch,
                    "best_s": min(times),
                    "median_s": statistics.median(times),
                    "texts_per_s": len(texts) / min(times),
                }
            )
    shape = {
        "texts": len(texts),
        "words_mean": statistics.mean(lengths),
        "tokens_mean": statistics.mean(tokens),
        "tokens_max": max(tokens),
    }
    return rows, load_s, shape


def bench_retrieval(sizes: list[int], k: int, dim: int = 384) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        vecs = normalize_rows(rng.normal(size=(n, dim)))
        queries = normalize_rows(rng.normal(size=(100, dim)))
        for label, q, normalized in (
            ("1 query", queries[:1], True),
            ("1 query, re-normalise", queries[:1], False),
            ("100 queries", queries, True),
        ):
            reps = max(5, min(2000, int(2e7 / (n * dim * len(q)))))
            for _ in range(3):
                nearest(q, vecs, k, normalized=normalized)
            samples = []
            for _ in range(reps):
                t = time.perf_counter()
                nearest(q, vecs, k, normalized=normalized)
                samples.append(time.perf_counter() - t)
            samples.sort()
            rows.append(
                {
                    "vectors": n,
                    "queries": label,
                    "k": k,
                    "p50_ms": 1e3 * samples[len(samples) // 2],
                    "p99_ms": 1e3 * samples[min(len(samples) - 1, int(len(samples) * 0.99))],
                    "reps": reps,
                }
            )
    return rows


def bench_routing(sizes: list[int], k: int, problems: int = 100, dim: int = 384) -> list[dict]:
    """``select_experiences`` for one step (``problems`` problems, top-``k``) over libraries of ``sizes`` lessons:
    what ``library.injection: top_k`` adds to a step once the vectors are stored (lookups by text, ranking)."""
    from clgrpo.experience.library import ExperienceLibrary, normalize_text
    from clgrpo.experience.retrieval import select_experiences
    from schemas.records import Experience, Problem

    rng = np.random.default_rng(1)
    rows = []
    for n in sizes:
        library = ExperienceLibrary(
            [Experience(id=f"E{i}", text=f"lesson number {i} about topic {i % 97}") for i in range(n)]
        )
        todo = [Problem(problem_id=f"p{j}", problem=f"problem number {j}") for j in range(problems)]
        texts = [e.text for e in library] + [p.problem for p in todo]
        units = normalize_rows(rng.normal(size=(len(texts), dim)))
        vectors = {normalize_text(t): v.tolist() for t, v in zip(texts, units)}
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            shown = select_experiences(library, todo, top_k=k, vectors=vectors)
            samples.append(time.perf_counter() - t)
        assert shown is not None and all(len(ids) == k for ids in shown.values())
        rows.append({"lessons": n, "problems": problems, "k": k, "median_ms": 1e3 * statistics.median(samples)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch-sizes", default="32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    try:
        emb_rows, load_s, shape = bench_embedding(threads, batch_sizes, args.repeats)
    except EmbeddingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"\nall-MiniLM-L6-v2 on CPU: {shape['texts']} lesson-like texts, {shape['words_mean']:.1f} words / "
        f"{shape['tokens_mean']:.1f} tokens on average (max {shape['tokens_max']}); model load {load_s:.2f} s"
    )
    print(f"{'threads':>7} {'batch':>5} {'s/1000 best':>12} {'median':>8} {'texts/s':>8}")
    for r in emb_rows:
        print(
            f"{r['threads']:>7} {r['batch_size']:>5} {r['best_s']:>12.2f} {r['median_s']:>8.2f} "
            f"{r['texts_per_s']:>8.0f}"
        )
    ret_rows = bench_retrieval([int(x) for x in args.sizes.split(",")], args.k)
    print(f"\ntop-{args.k} retrieval (nearest, numpy, 384 dims)")
    print(f"{'vectors':>8} {'queries':<22} {'p50 ms':>8} {'p99 ms':>8}")
    for r in ret_rows:
        print(f"{r['vectors']:>8} {r['queries']:<22} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")
    routing = bench_routing([int(x) for x in args.sizes.split(",")], args.k)
    print(f"\nrouting one step (select_experiences, top-{args.k}, vectors already stored)")
    print(f"{'lessons':>8} {'problems':>8} {'median ms':>10}")
    for r in routing:
        print(f"{r['lessons']:>8} {r['problems']:>8} {r['median_ms']:>10.1f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"embedding": emb_rows, "load_s": load_s, "texts": shape, "retrieval": ret_rows, "routing": routing},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
