"""Benchmarks behind `fedring bench`: ours beside the baselines, measured in one run."""
