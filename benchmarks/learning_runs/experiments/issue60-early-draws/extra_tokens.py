"""Issue 60 part 2: what the gate's early draws cost beyond what the gate used, per run of /work/issue60/early.duckdb.
A 1-step run: early samples are used when its gate ran (look 1's library-before arm); when no gate ran (the plan
changed nothing) they are stored for a next step that does not come: extra."""

import json
import sys

import duckdb

c = duckdb.connect(sys.argv[1] if len(sys.argv) > 1 else "/work/issue60/early.duckdb", read_only=True)
rows = []
for (run,) in c.execute("select distinct run_id from runs order by 1").fetchall():
    by = dict(
        c.execute(
            "select stage, sum(tokens_in+tokens_out) from llm_calls where run_id=? group by stage", [run]
        ).fetchall()
    )
    gates = c.execute("select count(*) from library_gates where run_id=?", [run]).fetchone()[0]
    early = c.execute(
        "select count(*), sum(tokens_in+tokens_out) from llm_calls where run_id=? and stage='library_gate'", [run]
    ).fetchone()
    checks = by.get("validate_lessons", 0) + by.get("library_gate", 0)
    own = sum(
        v
        for k, v in by.items()
        if k in ("rollout", "verify", "summarize", "group_advantage", "rationalize", "consolidate")
    )
    extra = 0 if gates else (early[1] or 0)
    rows.append(
        dict(
            run=run,
            own=own,
            checks=checks,
            gate_ran=bool(gates),
            gate_calls=early[0],
            extra=extra,
            extra_share=round(extra / checks, 3) if checks else None,
            checks_ratio=round(1 + checks / own, 2) if own else None,
        )
    )
for r in rows:
    print(json.dumps(r))
tot_extra = sum(r["extra"] for r in rows)
tot_checks = sum(r["checks"] for r in rows)
print(f"all runs: extra {tot_extra:,} of {tot_checks:,} checks tokens ({tot_extra / max(1, tot_checks):.1%})")
