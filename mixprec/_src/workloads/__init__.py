"""Workloads (models, data, FLOP counts) shared by the benchmarks and the CLI."""
