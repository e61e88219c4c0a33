"""Data contracts: pydantic records, the run config, pandera frames and the DuckDB DDL."""
