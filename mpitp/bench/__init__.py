"""Benchmarks that users run on their own machines (``mpitp bench``)."""
