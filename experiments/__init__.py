"""The evaluation runner (`python -m experiments.longbench`): suites, runs, reports."""
