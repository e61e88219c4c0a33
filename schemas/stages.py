"""Stage names: the one list of the stages whose rows the store keys by (run_id, step, stage).

The values are stored in DuckDB (``stage_runs.stage`` and every stage table), shown in log lines and terminal
progress bars, and name the Prefect task runs, so they never change. What differs between stages is data
with the stage (its failure rule and tolerance, whether its work journal keeps finished items: ``flows/step.py``
``STEP``), not if-chains on the names in the code that uses them.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    # a training run: its dataset (step 0), then per step in this order (flows/step.py lists the step)
    LOAD_DATASET = "load_dataset"
    ROLLOUT = "rollout"
    VERIFY = "verify"  # rewards, and the numeric group advantages they give (verify's second output)
    NUMERIC_UPDATE = "numeric_update"  # hybrid learning's LoRA step, after verify (table adapters)
    SUMMARIZE = "summarize"
    GROUP_ADVANTAGE = "group_advantage"  # the semantic group advantage: the learner's proposals
    RATIONALIZE = "rationalize"  # worked examples written with the reference in view, for groups none solved
    CONSOLIDATE = "consolidate"
    VALIDATE_LESSONS = "validate_lessons"
    LIBRARY_GATE = "library_gate"  # the library before vs after the step's plan, on problems set aside
    APPLY_OPERATIONS = "apply_operations"
    CHECKPOINT = "checkpoint"  # the last stage of a training step: a step is done when it is stored
    # rollout -> group advantage group by group; a Prefect task name only: its outputs are stored as those four
    PIPELINE = "pipeline"
    # evaluation rows: held-out validation keyed by the training (run_id, step), and standalone evaluations
    # keyed by (eval_id, 0)
    VALIDATE = "validate"
    EVALUATE = "evaluate"
    # a refresh's rows, keyed by (refresh_id, 0): the problems it took, the promotion gate's rows (overall and
    # per task tag), then its decision
    REFRESH_SELECT = "refresh-select"
    REFRESH_GATE = "refresh-gate"
    REFRESH_DECIDE = "refresh-decide"
    # human review of a refresh's changes, keyed by (refresh_id, 0): the request, then the reviewer's answers;
    # and the adopted library's history, keyed by (name, seq): promotions and rollbacks
    REVIEW_REQUEST = "review-request"
    REVIEW_DECIDE = "review-decide"
    ADOPT = "adopt"
