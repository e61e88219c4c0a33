"""Prefix-cache layout: the share of rollout prompt tokens that is a prefix shared by every rollout of a step.

A step's rollouts are built exactly as the rollout stage builds them (``Domain.rollout_messages`` with the
library rendered for the prompt), for the 30 AIME 2024 problems and a 30-experience library (the reference
library's 27 plus 3 more). The prompts are serialized as a chat template would (role marker, content, per
message) and tokenized with a simple word/punctuation tokenizer (``\\w+|[^\\w\\s]``); the shared prefix is the
longest common token prefix of all prompts. Deterministic: one run is the figure.

``--top-k K`` adds the same measurement with ``library.injection: top_k`` (each problem's prompt gets its K most
similar experiences, embedded with the embedded all-MiniLM-L6-v2, which must be fetched: ``clgrpo model fetch
--embeddings``): fewer prompt tokens, but the library block differs between problems, so the shared prefix ends
where it starts.

    python benchmarks/prefix.py [--library FILE] [--problems FILE] [--top-k 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clgrpo.experience.library import ExperienceLibrary  # noqa: E402
from clgrpo.experience.tokens import TOKEN  # noqa: E402
from domains import get_domain  # noqa: E402
from schemas.config import DatasetConfig  # noqa: E402
from schemas.records import Operation  # noqa: E402

FIXTURES = ROOT / "tests" / "data"
EXTRA_EXPERIENCES = (
    "Modular arithmetic: reduce large powers with Euler's theorem or cycle detection before computing, and check "
    "the final residue against small cases.",
    "Answer format: when the answer must be written as m/n or a+b*sqrt(c), simplify fully and confirm the "
    "coprimality or square-free conditions before adding the parts.",
    "Counting with constraints: count the complement or use inclusion-exclusion when direct enumeration has many "
    "overlapping cases, then verify on a smaller instance.",
)


def tokens(messages: list[dict[str, str]]) -> list[str]:
    return TOKEN.findall("".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages))


def common_prefix(sequences: list[list[str]]) -> int:
    first = sequences[0]
    for i, token in enumerate(first):
        if any(len(s) <= i or s[i] != token for s in sequences[1:]):
            return i
    return len(first)


def library_of(path: Path, size: int) -> ExperienceLibrary:
    """The first ``size`` of the reference library's experiences, then the extra ones."""
    texts = [*ExperienceLibrary.load(path).as_dict().values(), *EXTRA_EXPERIENCES][:size]
    library, results = ExperienceLibrary().apply([Operation(op="add", text=t) for t in texts], step=1, max_words=100)
    assert all(r.status.value == "applied" for r in results), [r.reason for r in results]
    return library


def routed(library: ExperienceLibrary, problems: list, top_k: int) -> ExperienceLibrary:
    """``library`` with each problem routed to its ``top_k`` nearest experiences (the embedded model)."""
    from clgrpo.experience.retrieval import route_library
    from schemas.config import LibraryConfig, RunConfig

    config = RunConfig(dataset=DatasetConfig(hf_name="unused"), library=LibraryConfig(injection="top_k", top_k=top_k))
    return asyncio.run(route_library(config, None, library, problems))


def measure(library: ExperienceLibrary, problems_path: Path, group_size: int = 5, top_k: int | None = None) -> dict:
    domain = get_domain("math")
    problems, _ = domain.load_dataset(DatasetConfig(path=str(problems_path), shuffle=False))
    if top_k is not None:
        library = routed(library, problems, top_k)
    prompts = [
        tokens(domain.rollout_messages(p, library.prompt_text_for(p.problem_id)))
        for p in problems
        for _ in range(group_size)
    ]
    shared = common_prefix(prompts)
    total = sum(len(p) for p in prompts)
    return {
        "problems": len(problems),
        "rollouts": len(prompts),
        "library_size": len(library),
        "injection": "all" if top_k is None else f"top_{top_k}",
        "shared_prefix_tokens": shared,
        "mean_prompt_tokens": total / len(prompts),
        "min_prompt_tokens": min(len(p) for p in prompts),
        "max_prompt_tokens": max(len(p) for p in prompts),
        "prefix_share": shared * len(prompts) / total,
        "median_per_prompt_share": statistics.median(shared / len(p) for p in prompts),
        "min_per_prompt_share": min(shared / len(p) for p in prompts),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", type=Path, default=FIXTURES / "reference_library_math.json")
    parser.add_argument("--problems", type=Path, default=FIXTURES / "aime2024.jsonl")
    parser.add_argument("--size", type=int, default=30, help="experiences in the library (reference + extra)")
    parser.add_argument("--top-k", type=int, help="also measure injection top_k with this k (embedded model)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = [measure(library_of(args.library, size), args.problems) for size in sorted({0, 10, args.size})]
    if args.top_k:
        rows.append(measure(library_of(args.library, args.size), args.problems, top_k=args.top_k))
    print(
        f"{'library':>8} {'injection':>10} {'shared prefix':>14} {'mean prompt':>12} {'prefix share':>13} "
        f"{'min per prompt':>15}"
    )
    for r in rows:
        print(
            f"{r['library_size']:>8} {r['injection']:>10} {r['shared_prefix_tokens']:>14} "
            f"{r['mean_prompt_tokens']:>12.0f} {r['prefix_share']:>13.1%} {r['min_per_prompt_share']:>15.1%}"
        )
    print(
        "tokens: \\w+|[^\\w\\s] over '<|role|>\\ncontent\\n' per message; "
        f"{rows[-1]['problems']} problems x G=5 rollouts"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
