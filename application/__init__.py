"""The application shell: the ``clgrpo`` command line, the offline demo, the terminal display, the CLI's memory of
recent databases, and the helpers that start servers for a command (Prefect's temporary API server, llama.cpp).

The top layer: it may import flows, tasks, domains and the core; nothing below imports it (pyproject.toml,
``[tool.importlinter]``).
"""
