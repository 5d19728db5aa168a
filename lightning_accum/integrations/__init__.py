"""Integrations with experiment trackers. Each module imports its tracker lazily, so the package works without it."""
