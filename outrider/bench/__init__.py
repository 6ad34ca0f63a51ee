"""Benchmarking: workloads from real text, methods side by side, reports."""
