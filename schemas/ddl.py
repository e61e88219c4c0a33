"""DuckDB schema: the one place where tables are defined.

Stage tables carry (run_id, step, stage): the store replaces a stage's rows by that key, so re-writing a
stage never duplicates. Nested values (turns, id lists, operations) are JSON text.
"""

from __future__ import annotations

STAGE_KEY = ("run_id", "step", "stage")
CHECKPOINT_STAGE = "checkpoint"  # the last stage of a training step: a step is done when it is stored
# Stage names of evaluation rows: held-out validation keyed by the training (run_id, step), and standalone
# evaluations keyed by (eval_id, 0).
VALIDATE_STAGE = "validate"
EVALUATE_STAGE = "evaluate"
# Stage names of a refresh's rows, keyed by (refresh_id, 0): the problems it took, then its decision.
REFRESH_SELECT_STAGE = "refresh-select"
REFRESH_DECIDE_STAGE = "refresh-decide"
NUMERIC_UPDATE_STAGE = "numeric_update"  # hybrid learning's LoRA step, after verify (table adapters)
REFRESH_GATE_STAGE = "refresh-gate"  # the promotion gate's rows (overall and per task tag), before the decision
# Human review of a refresh's changes, keyed by (refresh_id, 0): the request, then the reviewer's answers;
# and the adopted library's history, keyed by (name, seq): promotions and rollbacks.
REVIEW_REQUEST_STAGE = "review-request"
REVIEW_DECIDE_STAGE = "review-decide"
ADOPT_STAGE = "adopt"

TABLE_DDL: dict[str, str] = {
    # one row: this database's identity (a uuid made when the file is created); work journals and anything
    # else kept outside the file are keyed by it, so a new or re-created database never picks up stale work
    "db_meta": """
        key VARCHAR PRIMARY KEY,
        value VARCHAR NOT NULL""",
    "runs": """
        run_id VARCHAR PRIMARY KEY,
        fingerprint VARCHAR NOT NULL,
        config_json VARCHAR NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        status VARCHAR,
        updated_at TIMESTAMPTZ,
        error VARCHAR""",
    "stage_runs": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        n_rows INTEGER NOT NULL,
        completed_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (run_id, step, stage)""",
    "problems": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        position INTEGER NOT NULL,
        problem_id VARCHAR NOT NULL,
        problem VARCHAR NOT NULL,
        answer VARCHAR,
        source VARCHAR NOT NULL""",
    "rollouts": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        problem_id VARCHAR NOT NULL,
        sample_idx INTEGER NOT NULL,
        prompt_hash VARCHAR NOT NULL,
        library_version INTEGER NOT NULL,
        turns_json VARCHAR NOT NULL,
        final_text VARCHAR NOT NULL,
        tokens_in INTEGER NOT NULL,
        tokens_out INTEGER NOT NULL,
        latency_s DOUBLE NOT NULL,
        error VARCHAR,
        finish_reason VARCHAR,
        n_turns INTEGER,
        tool_calls INTEGER,
        tool_errors INTEGER,
        tool_time_s DOUBLE""",
    "rewards": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        problem_id VARCHAR NOT NULL,
        sample_idx INTEGER NOT NULL,
        reward DOUBLE,
        extracted VARCHAR,
        error VARCHAR,
        verified BOOLEAN""",
    "group_advantages": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        problem_id VARCHAR NOT NULL,
        rewards_json VARCHAR NOT NULL,
        mean_reward DOUBLE NOT NULL,
        std_reward DOUBLE NOT NULL,
        advantages_json VARCHAR NOT NULL,
        selected BOOLEAN NOT NULL,
        reason VARCHAR NOT NULL""",
    "summaries": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        problem_id VARCHAR NOT NULL,
        sample_idx INTEGER NOT NULL,
        text VARCHAR NOT NULL,
        error VARCHAR""",
    "proposals": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        group_id VARCHAR NOT NULL,
        n_operations INTEGER NOT NULL,
        operations_json VARCHAR NOT NULL,
        raw_text VARCHAR NOT NULL,
        parse_error VARCHAR""",
    "operations": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        seq INTEGER NOT NULL,
        op VARCHAR NOT NULL,
        target_ids_json VARCHAR NOT NULL,
        text VARCHAR,
        rationale VARCHAR NOT NULL,
        source_groups_json VARCHAR NOT NULL,
        status VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        result_id VARCHAR""",
    "llm_calls": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        role VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        tokens_in INTEGER NOT NULL,
        tokens_out INTEGER NOT NULL,
        latency_s DOUBLE NOT NULL,
        retries INTEGER NOT NULL,
        cost_usd DOUBLE NOT NULL,
        ok BOOLEAN NOT NULL,
        error VARCHAR,
        started_at TIMESTAMPTZ NOT NULL,
        call_id VARCHAR,
        finish_reason VARCHAR,
        rate_limited BOOLEAN,
        final BOOLEAN,
        turn INTEGER,
        reply VARCHAR""",
    "lesson_trials": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        seq INTEGER NOT NULL,
        operation_json VARCHAR NOT NULL,
        problem_ids_json VARCHAR NOT NULL,
        samples INTEGER NOT NULL,
        pairs INTEGER NOT NULL,
        mean_without DOUBLE,
        mean_with DOUBLE,
        gain DOUBLE,
        verdict VARCHAR NOT NULL,
        reason VARCHAR NOT NULL""",
    "trial_samples": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        seq INTEGER NOT NULL,
        problem_id VARCHAR NOT NULL,
        sample_idx INTEGER NOT NULL,
        seed BIGINT NOT NULL,
        reward DOUBLE,
        extracted VARCHAR,
        error VARCHAR,
        final_text VARCHAR NOT NULL,
        tokens_in INTEGER NOT NULL,
        tokens_out INTEGER NOT NULL""",
    "library_versions": """
        run_id VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        step INTEGER NOT NULL,
        parent_version INTEGER,
        next_id INTEGER NOT NULL,
        id_prefix VARCHAR NOT NULL,
        n_experiences INTEGER NOT NULL,
        content_hash VARCHAR NOT NULL,
        retired_ids_json VARCHAR NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (run_id, version)""",
    "library_experiences": """
        run_id VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        position INTEGER NOT NULL,
        exp_id VARCHAR NOT NULL,
        text VARCHAR NOT NULL,
        created_step INTEGER NOT NULL,
        updated_step INTEGER NOT NULL,
        parent_ids_json VARCHAR NOT NULL,
        source_groups_json VARCHAR NOT NULL""",
    # per step (stage checkpoint): usefulness and confidence of the experiences live after the step
    "experience_stats": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        exp_id VARCHAR NOT NULL,
        cited INTEGER NOT NULL,
        cited_correct DOUBLE NOT NULL,
        cited_wrong DOUBLE NOT NULL,
        cited_in_variance INTEGER NOT NULL,
        confidence DOUBLE NOT NULL,
        ci_low DOUBLE NOT NULL,
        ci_high DOUBLE NOT NULL""",
    # per step (stage checkpoint): the library version as a whole (clgrpo.quality)
    "library_quality": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        size INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        near_duplicates INTEGER NOT NULL,
        duplicate_ratio DOUBLE NOT NULL,
        mean_confidence DOUBLE,
        never_cited_share DOUBLE,
        coverage DOUBLE,
        coverage_problems INTEGER NOT NULL,
        added INTEGER NOT NULL,
        modified INTEGER NOT NULL,
        deleted INTEGER NOT NULL,
        evicted INTEGER NOT NULL""",
    # embeddings of texts (lessons, operation texts), computed once per text and model and shared by all runs
    "embeddings": """
        model VARCHAR NOT NULL,
        text_hash VARCHAR NOT NULL,
        dim INTEGER NOT NULL,
        vector FLOAT[] NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (model, text_hash)""",
    # evaluations: (run_id, step) is the training run and step for validation, (eval_id, 0) when standalone
    "evaluations": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        eval_id VARCHAR NOT NULL,
        condition VARCHAR NOT NULL,
        library_ref VARCHAR NOT NULL,
        library_hash VARCHAR NOT NULL,
        library_size INTEGER NOT NULL,
        dataset VARCHAR NOT NULL,
        fingerprint VARCHAR NOT NULL,
        n_problems INTEGER NOT NULL,
        k INTEGER NOT NULL,
        pass_k INTEGER NOT NULL,
        temperature DOUBLE NOT NULL,
        seed BIGINT NOT NULL,
        ci_level DOUBLE NOT NULL,
        mean_at_k DOUBLE NOT NULL,
        mean_ci_low DOUBLE NOT NULL,
        mean_ci_high DOUBLE NOT NULL,
        pass_at_k DOUBLE NOT NULL,
        pass_ci_low DOUBLE NOT NULL,
        pass_ci_high DOUBLE NOT NULL,
        n_failed INTEGER NOT NULL,
        leaked_ids_json VARCHAR NOT NULL,
        created_at TIMESTAMPTZ NOT NULL""",
    "eval_results": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        condition VARCHAR NOT NULL,
        problem_id VARCHAR NOT NULL,
        sample_idx INTEGER NOT NULL,
        seed BIGINT NOT NULL,
        reward DOUBLE NOT NULL,
        extracted VARCHAR,
        error VARCHAR,
        final_text VARCHAR NOT NULL,
        tokens_in INTEGER NOT NULL,
        tokens_out INTEGER NOT NULL,
        latency_s DOUBLE NOT NULL,
        n_turns INTEGER,
        tool_calls INTEGER,
        tool_errors INTEGER""",
    "eval_comparisons": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        eval_id VARCHAR NOT NULL,
        baseline VARCHAR NOT NULL,
        candidate VARCHAR NOT NULL,
        metric VARCHAR NOT NULL,
        baseline_value DOUBLE NOT NULL,
        candidate_value DOUBLE NOT NULL,
        diff DOUBLE NOT NULL,
        ci_low DOUBLE NOT NULL,
        ci_high DOUBLE NOT NULL,
        ci_level DOUBLE NOT NULL,
        n_problems INTEGER NOT NULL""",
    # nightly refreshes: (run_id, step, stage) is (refresh_id, 0, refresh-select | refresh-decide)
    "refresh_inputs": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        position INTEGER NOT NULL,
        problem_id VARCHAR NOT NULL,
        problem VARCHAR NOT NULL,
        answer VARCHAR,
        source VARCHAR NOT NULL,
        arrived_at TIMESTAMPTZ NOT NULL,
        problem_key VARCHAR NOT NULL""",
    "refreshes": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        refresh_id VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        refresh_date VARCHAR NOT NULL,
        cutoff TIMESTAMPTZ NOT NULL,
        status VARCHAR NOT NULL,
        n_new_problems INTEGER NOT NULL,
        baseline_ref VARCHAR NOT NULL,
        candidate_ref VARCHAR,
        train_run_id VARCHAR,
        eval_id VARCHAR,
        metric VARCHAR NOT NULL,
        baseline_value DOUBLE,
        candidate_value DOUBLE,
        diff DOUBLE,
        ci_low DOUBLE,
        ci_high DOUBLE,
        ci_level DOUBLE,
        margin DOUBLE NOT NULL,
        reasons_json VARCHAR NOT NULL,
        decided_at TIMESTAMPTZ NOT NULL""",
    # a refresh's promotion gate, (refresh_id, 0, refresh-gate): the overall row (tag NULL) and one per task tag
    "refresh_gate": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        refresh_id VARCHAR NOT NULL,
        tag VARCHAR,
        metric VARCHAR NOT NULL,
        n_problems INTEGER NOT NULL,
        baseline_value DOUBLE NOT NULL,
        candidate_value DOUBLE NOT NULL,
        diff DOUBLE NOT NULL,
        ci_low DOUBLE NOT NULL,
        ci_high DOUBLE NOT NULL,
        ci_level DOUBLE NOT NULL,
        threshold DOUBLE NOT NULL,
        verdict VARCHAR NOT NULL,
        reason VARCHAR NOT NULL""",
    # a traces refresh (refresh-select stage): the source rows it skipped, and the watermark it read up to
    "refresh_rejects": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        file VARCHAR NOT NULL,
        line INTEGER NOT NULL,
        reason VARCHAR NOT NULL""",
    # per training step with hybrid learning (stage numeric_update): the LoRA adapter it saved
    "adapters": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        base_model VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        rows_used INTEGER NOT NULL,
        rows_skipped INTEGER NOT NULL,
        loss_before DOUBLE,
        loss_after DOUBLE,
        logprob_change_pos DOUBLE,
        logprob_change_neg DOUBLE,
        library_version INTEGER NOT NULL,
        parent_path VARCHAR,
        path VARCHAR NOT NULL,
        device VARCHAR NOT NULL,
        seconds DOUBLE NOT NULL,
        created_at TIMESTAMPTZ NOT NULL""",
    "refresh_watermarks": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        after TIMESTAMPTZ,
        watermark TIMESTAMPTZ,
        n_rows INTEGER NOT NULL,
        n_rejected INTEGER NOT NULL,
        n_redacted INTEGER NOT NULL""",
    # a refresh's changes waiting for a person (changes and the pending decision as JSON)
    "review_requests": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        refresh_id VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        flow_run_id VARCHAR,
        timeout_s INTEGER NOT NULL,
        deadline TIMESTAMPTZ NOT NULL,
        changes_json VARCHAR NOT NULL,
        pending_json VARCHAR NOT NULL,
        config_json VARCHAR NOT NULL,
        created_at TIMESTAMPTZ NOT NULL""",
    # one row per reviewed change: the reviewer's decision and what it did
    "review_decisions": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        change_id VARCHAR NOT NULL,
        op VARCHAR NOT NULL,
        exp_id VARCHAR NOT NULL,
        before VARCHAR,
        proposed VARCHAR,
        after VARCHAR,
        decision VARCHAR NOT NULL,
        adopted BOOLEAN NOT NULL,
        reason VARCHAR NOT NULL,
        reviewer VARCHAR NOT NULL,
        decided_at TIMESTAMPTZ NOT NULL""",
    # promotions and rollbacks of the library a refresh name serves (its exported promoted.json)
    "library_adoptions": """
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        stage VARCHAR NOT NULL,
        name VARCHAR NOT NULL,
        seq INTEGER NOT NULL,
        action VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        from_version INTEGER,
        refresh_id VARCHAR NOT NULL,
        library_ref VARCHAR NOT NULL,
        content_hash VARCHAR NOT NULL,
        folder VARCHAR NOT NULL,
        actor VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        adopted_at TIMESTAMPTZ NOT NULL""",
}

# Tables written through Store.write_stage, replaced as a unit by (run_id, step, stage).
STAGE_TABLES = (
    "problems",
    "rollouts",
    "rewards",
    "group_advantages",
    "summaries",
    "proposals",
    "operations",
    "llm_calls",
)
STAGE_TABLES += ("evaluations", "eval_results", "eval_comparisons", "refresh_inputs", "refreshes", "experience_stats")
STAGE_TABLES += (
    "library_quality",
    "lesson_trials",
    "trial_samples",
    "refresh_gate",
    "refresh_rejects",
    "refresh_watermarks",
    "adapters",
)
STAGE_TABLES += ("review_requests", "review_decisions", "library_adoptions")


# Columns added after the first release: files created before get them on open.
ADDED_COLUMNS: dict[str, list[str]] = {
    "runs": ["status VARCHAR", "updated_at TIMESTAMPTZ", "error VARCHAR"],
    "rollouts": [
        "finish_reason VARCHAR",
        "n_turns INTEGER",
        "tool_calls INTEGER",
        "tool_errors INTEGER",
        "tool_time_s DOUBLE",
    ],
    "rewards": ["verified BOOLEAN", "judge_reason VARCHAR", "reward_source VARCHAR"],
    "problems": ["domain_tag VARCHAR", "tag VARCHAR", "answer_source VARCHAR"],
    "refresh_inputs": ["tag VARCHAR", "answer_source VARCHAR", "rejected_answer VARCHAR"],
    "library_experiences": ["domain_tag VARCHAR"],
    "eval_comparisons": ["tag VARCHAR"],  # NULL: over all problems (every row written before tags)
    "eval_results": ["n_turns INTEGER", "tool_calls INTEGER", "tool_errors INTEGER", "judge_reason VARCHAR"],
    "llm_calls": [
        "call_id VARCHAR",
        "finish_reason VARCHAR",
        "rate_limited BOOLEAN",
        "final BOOLEAN",
        "turn INTEGER",
        "reply VARCHAR",
    ],
}
# NOT NULL constraints lifted after the first release
DROPPED_NOT_NULL: dict[str, list[str]] = {"rewards": ["reward"]}

# Tables with a run_id column: everything `Store.delete_run` removes.
RUN_TABLES = ("runs", "stage_runs", *dict.fromkeys(STAGE_TABLES), "library_versions", "library_experiences")


def create_statements() -> list[str]:
    tables = [f"CREATE TABLE IF NOT EXISTS {name} ({body}\n)" for name, body in TABLE_DDL.items()]
    columns = [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c}" for t, cs in ADDED_COLUMNS.items() for c in cs]
    nullable = [f"ALTER TABLE {t} ALTER COLUMN {c} DROP NOT NULL" for t, cs in DROPPED_NOT_NULL.items() for c in cs]
    return tables + columns + nullable
import clgrpo.errors  # noqa: F401,E402  TEST: schemas -> core
