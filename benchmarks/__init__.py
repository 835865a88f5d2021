"""Benchmarks and the workloads they share."""
