"""What a run reads: its config (YAML with overrides), its problems, and the train/held-out leakage guard."""
