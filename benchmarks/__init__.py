"""Benchmarks and developer tools (not part of the installed package)."""
