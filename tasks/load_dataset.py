"""Stage: load, validate and order the training problems."""

from __future__ import annotations

from prefect import get_run_logger

from clgrpo.inputs.dataset import LoadReport
from domains import domain_for
from schemas.config import RunConfig
from schemas.records import Problem
from schemas.stages import Stage
from tasks.common import stage_task


def load_dataset(config: RunConfig) -> tuple[list[Problem], LoadReport]:
    return domain_for(config).load_dataset(config.dataset)


@stage_task(Stage.LOAD_DATASET, run_name="load-dataset")
def load_dataset_task(config: RunConfig, source_digest: str) -> list[Problem]:
    """``source_digest`` (the data file's content hash) only keys the cache: a changed file is reloaded."""
    problems, report = load_dataset(config)
    get_run_logger().info(
        "dataset %s: %d valid rows, %d duplicates dropped%s, %d problems used",
        report.source,
        report.n_rows,
        report.n_duplicates_dropped,
        f" ({', '.join(report.dropped_ids[:10])})" if report.dropped_ids else "",
        report.n_after_limit,
    )
    log_oversize(report)
    return problems


def log_oversize(report: LoadReport) -> None:
    """Rows left out for their size (``dataset.oversize: skip``) are reported, never dropped silently."""
    if report.n_oversize_skipped:
        get_run_logger().warning(
            "dataset %s: skipped %d row(s) over the size limits (dataset.oversize: skip): %s",
            report.source,
            report.n_oversize_skipped,
            ", ".join(report.oversize_ids[:20]),
        )
