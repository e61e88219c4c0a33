"""Reports and their statistics: metrics with confidence intervals, plots, a run's learning report."""
