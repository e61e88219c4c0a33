"""How a clgrpo process runs and ends: settings, stop signals, progress, one-line errors, the sweep after a kill."""
