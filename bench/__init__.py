"""Benchmarks: each prints a table and a final `RESULT {json}` line."""
