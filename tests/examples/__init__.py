"""Tests of the examples under the repository's top-level ``examples/``."""
