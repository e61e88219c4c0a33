"""What a run keeps on disk: the DuckDB store, work journals, run locks, recent databases, stale flow runs."""
