"""The experience library and its measures: versions, tokens, usefulness, quality, what each prompt shows."""
