"""Experiments: sweeps and suites of runs, their results tables and figures (`report` reads
every run directory), and the studies of the estimators."""
