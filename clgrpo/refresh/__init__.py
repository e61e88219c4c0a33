"""The nightly refresh: new problems and traces (redacted), the promotion gate, review, adoption for serving."""
