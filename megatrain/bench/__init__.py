"""Benchmark cases, records, metrics, suites and reports."""
