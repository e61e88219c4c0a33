"""README.md and docs/ stay true: the layout names what the tree holds, every link resolves, every page of docs/ is
reachable from the README, and every shell command they show is accounted for.

A command is accounted for when it is run by a named test (the test must exist), run by ``.ci/run``, or listed
with the reason it cannot be run here (an API key, a GPU, minutes of real-model time). Every ``clgrpo`` command
shown is also parsed by the real argument parser, and a usage line of the CLI section must name only options its
command has: a renamed flag fails here. A command that matches no entry, or an entry that matches no command,
fails too, so the list follows the pages."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from application.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

# --- what runs each command ------------------------------------------------------------------------------------
CI = "run by .ci/run (a fresh virtualenv, the install, the checks, the tests)"
KEY = "not run here: needs an API key (DeepSeek)"
GPU = "not run here: needs a GPU worker (the cuda pool)"
REAL_MODEL = "not run in the default tests: minutes of a real model on 2 cores"
COVERAGE: list[tuple[str, str]] = [
    # setup
    (r"python3 -m venv \.venv.*", CI),
    (r"python -m pip install --upgrade pip", CI),
    (r'pip install "torch==2\.13\.0"( && pip install -e "\.\[local,dev\]")?', CI),
    (r'pip install -e "\.\[local,dev\]"', CI),
    (r"python -m pytest -q", CI),
    (r"clgrpo --version", "tests/test_cli.py::test_version"),
    # the demo and its follow-ups
    (r"clgrpo demo", "tests/test_demo.py::test_default_demo_learns_and_checks_on_held_out_problems (-m demo)"),
    (
        r"clgrpo data make .*",
        "tests/test_synthetic.py::test_cli_data_make_writes_a_held_out_set_disjoint_from_training",
    ),
    (r"clgrpo model serve qwen2\.5-coder-0\.5b .*", f"{REAL_MODEL} (the demo serves the same model the same way)"),
    (r"clgrpo model serve smollm2-135m .*", "tests/test_llama_server.py::test_model_serve_says_a_crash_in_one_line"),
    (
        r"clgrpo eval .*--config configs/qwen-local\.yaml",
        "tests/test_cli.py::test_a_run_without_summaries_and_an_eval_with_another_config",
    ),
    # quickstart and backends
    (r"export DEEPSEEK_API_KEY=\.\.\.", KEY),
    (r"clgrpo train --config configs/deepseek\.yaml.*", KEY),
    (
        r"clgrpo report RUN_ID",
        "tests/test_evaluate_flow.py::test_validation_curve_report_and_eval_from_the_command_line",
    ),
    (r"clgrpo train --config configs/local\.yaml --set policy\.model=smollm2-135m", f"{REAL_MODEL} (40 problems)"),
    (
        r"clgrpo train --config configs/local\.yaml --set dataset\.path=my/problems\.jsonl .*",
        "an example: my/problems.jsonl is the user's",
    ),
    # the CLI section's usage lines are checked against the parser (see test_every_usage_line_names_real_options)
    (r"clgrpo .*\[.*|\[.*", "usage line"),
    # agent mode, the web domain, hybrid learning, the library
    (
        r"clgrpo train --config configs/agent\.yaml",
        "tests/test_agent_flow.py::test_two_agent_steps_learn_a_library_from_tool_use",
    ),
    (
        r"clgrpo train --config configs/local\.yaml --mode agent",
        "tests/test_agent_flow.py::test_two_agent_steps_learn_a_library_from_tool_use",
    ),
    (r"clgrpo eval .*--mode agent", "tests/test_agent_flow.py::test_agent_evaluation_with_the_text_protocol"),
    (
        r"clgrpo web-world",
        "tests/test_web_tools.py::test_the_web_world_command_serves_the_site_and_writes_the_questions",
    ),
    (
        r"clgrpo train --config configs/web\.yaml",
        "tests/test_web_flow.py::test_two_web_steps_learn_to_walk_the_site_graded_by_the_judge",
    ),
    (
        r"clgrpo eval --config configs/web\.yaml .*",
        "tests/test_web_flow.py::test_two_web_steps_learn_to_walk_the_site_graded_by_the_judge",
    ),
    (
        r"clgrpo train --config configs/transformers-local\.yaml --set hybrid\.enabled=true .*",
        "tests/test_hybrid.py::test_a_training_run_with_hybrid_learning_trains_one_adapter_per_step",
    ),
    (
        r"clgrpo eval --config .*adapter:hy:latest.*",
        "tests/test_hybrid.py::test_eval_conditions_adapter_and_both_use_the_stored_adapter",
    ),
    (
        r"clgrpo train --config configs/transformers-local\.yaml --run-id routed .*",
        "tests/test_library_intelligence.py::test_top_k_picks_the_most_similar_lessons_plus_the_pinned_ones",
    ),
    (r"clgrpo library (ops|show) routed", "tests/test_cli.py::test_train_then_inspect_from_the_command_line"),
    # evaluation and reports
    (
        r"clgrpo eval --library none --compare RUN_ID:latest --dataset data/heldout\.jsonl .*",
        "tests/test_evaluate_flow.py::test_validation_curve_report_and_eval_from_the_command_line",
    ),
    (
        r"clgrpo eval --library RUN_ID:1 --library RUN_ID:latest .*--refuse-on-leakage",
        "tests/test_evaluate_flow.py::test_leakage_guard_warns_with_ids_and_refuses_on_request",
    ),
    (r"clgrpo eval --library data/reference_library_math\.json .*configs/deepseek\.yaml", KEY),
    (
        r"clgrpo report RUN_ID --(db|format) .*",
        "tests/test_evaluate_flow.py::test_validation_curve_report_and_eval_from_the_command_line",
    ),
    # the nightly refresh and its review
    (r"cp new-problems\.jsonl data/incoming/", "tests/test_refresh_flow.py (problems arriving in a source directory)"),
    (r"clgrpo refresh run --config configs/refresh\.yaml", "tests/test_cli_errors.py::test_eval_and_refresh_preflight"),
    (
        r"clgrpo refresh history --name nightly",
        "tests/test_refresh_review.py::test_a_terminal_review_then_clgrpo_review_decisions_then_rollback",
    ),
    (r"clgrpo library show nightly-.*", "tests/test_cli.py::test_train_then_inspect_from_the_command_line"),
    (
        r"clgrpo review nightly-2026-11-23.*",
        "tests/test_refresh_review.py::test_a_terminal_review_then_clgrpo_review_decisions_then_rollback",
    ),
    (
        r"clgrpo library rollback nightly.*",
        "tests/test_refresh_review.py::test_a_terminal_review_then_clgrpo_review_decisions_then_rollback",
    ),
    # deployments
    (r"export (PREFECT_HOME|PORT|PREFECT_API_URL)=.*", "tests/test_deployments.py::stack (integration)"),
    (r"prefect server start .*", "tests/test_deployments.py::stack (integration)"),
    (r"bash deployments/(create-pools|deploy)\.sh", "tests/test_deployments.py::stack (integration)"),
    (r"clgrpo model list", "tests/test_models.py::test_cli_model_list_names_every_model"),
    (r"prefect worker start --pool cpu", "tests/test_deployments.py::stack (integration)"),
    (r"CUDA_VISIBLE_DEVICES=\d prefect worker start --pool cuda .*", f"{GPU}; the tests run a process worker on it"),
    (
        r"prefect deployment run 'train/train' .*",
        "tests/test_deployments.py::test_deployment_run_routes_rollouts_to_the_cuda_pool",
    ),
    (
        r"prefect deployment run 'refresh/nightly-refresh' .*",
        "tests/test_deployments.py::test_nightly_refresh_is_scheduled_and_a_run_without_new_data_says_so",
    ),
    # benchmarks
    (r"python benchmarks/learning\.py .*", f"{REAL_MODEL} (35-75 minutes each)"),
    (r"python benchmarks/\w+\.py.*", "a benchmark (make bench): minutes of load, not a test"),
]


def commands(text: str) -> list[str]:
    """The commands of the page's shell blocks: continuation lines joined, quoted newlines and heredocs kept in one
    command, comments and a trailing ``&`` dropped."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        current, heredoc = "", None
        for line in block.split("\n"):
            current = f"{current}\n{line}" if current else line
            if heredoc is not None:
                if line.strip() == heredoc:
                    heredoc = None
                continue
            if match := re.search(r"<<'?(\w+)'?", line):
                heredoc = match.group(1)
                continue
            if current.endswith("\\"):
                current = current[:-1].rstrip()
                continue
            if not _complete(current):
                continue
            command = _without_comment(current).strip().removesuffix("&").strip()
            current = ""
            if command:
                found.append(" ".join(command.split()))
    return found


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quotation: the command goes on on the next line
        return False
    return True


def _without_comment(text: str) -> str:
    # the comment starts at the first '#' outside quotes that follows whitespace
    quote, out = None, []
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t\n"):
            break
        out.append(ch)
    return "".join(out)


def coverage_of(command: str) -> tuple[str, str] | None:
    return next(((pattern, what) for pattern, what in COVERAGE if re.fullmatch(pattern, command)), None)


def all_commands() -> list[tuple[str, str]]:
    return [(page, c) for page in PAGES for c in commands((ROOT / page).read_text())]


# --- the tests -----------------------------------------------------------------------------------------------
def test_every_command_is_run_by_a_test_or_says_why_not():
    found = all_commands()
    assert len(found) > 80, "the command finder finds the pages' commands"
    unaccounted = [f"{page}: {c}" for page, c in found if coverage_of(c) is None]
    assert unaccounted == [], "commands no test runs and no reason excuses (add them to COVERAGE)"
    used = {coverage_of(c)[0] for _, c in found}
    assert [p for p, _ in COVERAGE if p not in used] == [], "COVERAGE entries that match no command any more"


@pytest.mark.parametrize("what", sorted({w for _, w in COVERAGE if w.startswith("tests/")}))
def test_every_named_test_exists(what):
    path, _, rest = what.partition("::")
    source = (ROOT / path.split(" ")[0]).read_text()
    name = re.match(r"\w+", rest).group(0) if rest else None
    assert name is None or re.search(rf"^(async )?def {name}\(", source, re.M), what


def test_every_clgrpo_command_parses_and_names_files_that_exist():
    parser = build_parser()
    for page, command in all_commands():
        words = shlex.split(command)
        if words[0] != "clgrpo" or "[" in command or "--version" in words:
            continue
        parser.parse_args(words[1:])  # a renamed subcommand or flag exits 2 here
        for word in words:
            if re.fullmatch(r"(configs|data)/[\w./-]+\.(ya?ml|jsonl|json)", word):
                assert (ROOT / word).is_file(), f"{page}: {command}: no {word}"


def test_every_usage_line_names_real_options():
    parser = build_parser()
    usage = [c for p, c in all_commands() if p == "README.md" and c.startswith("clgrpo ") and "[" in c]
    assert len(usage) > 15
    for line in usage:
        words = [w for w in re.split(r"[\s\[\]|]+", line) if w]
        sub = parser
        for word in words[1:]:  # walk down the subcommands
            choices = _subcommands(sub)
            if word not in choices:
                break
            sub = choices[word]
        options = {o for action in sub._actions for o in action.option_strings}
        named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
        assert named <= options, f"{line}: {sorted(named - options)} not options of this command"


def _subcommands(parser) -> dict:
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):
            return action.choices
    return {}


def test_the_command_finder_joins_and_strips():
    text = (
        "```bash\nclgrpo eval --k 2 \\\n    --dataset d.jsonl   # a comment\nfoo --params '{\"a\":\n 1}'\nx & \n```\n"
    )
    assert commands(text) == ["clgrpo eval --k 2 --dataset d.jsonl", "foo --params '{\"a\": 1}'", "x"]


# --- links and pages -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    text = (ROOT / page).read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / page).parent.joinpath(target).exists(), f"{page}: broken link {target}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert [p for p in PAGES[1:] if f"]({p})" not in readme] == []


# --- the layout ------------------------------------------------------------------------------------------------
CORE_ROOMS = ["refresh", "reports", "testing", "llm", "storage", "experience", "models", "inputs", "sandbox", "process",
              "prompts"]  # fmt: skip
PACKAGES = ["schemas", "clgrpo", "application", *(f"clgrpo/{room}" for room in CORE_ROOMS), "domains", "tasks", "flows"]
NOT_LISTED = {"README.md", ".gitignore"}  # the file itself, and git's own


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


@pytest.fixture(scope="module")
def files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_every_top_level_entry_is_named(files):
    block = layout_block()
    tops = {f.split("/")[0] for f in files} - NOT_LISTED
    assert sorted(t for t in tops if t not in block) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named(files, package):
    block = layout_block()
    modules = [Path(f).name for f in files if str(Path(f).parent) == package and f.endswith(".py")]
    assert [m for m in modules if m != "__init__.py" and m not in block] == []


def test_every_folder_the_layout_names_exists():
    for line in layout_block().splitlines():
        head = line.split(" ", 1)[0]
        if head.endswith("/"):
            assert (ROOT / head).is_dir(), head
