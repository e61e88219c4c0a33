"""clgrpo core: the experience library, the DuckDB store, the LLM client, config loading and the CLI."""

__version__ = "0.1.0"
