"""Run ``lightning-accum`` in-process and check the one-line error contract."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_accum.cli.main import main


@dataclass(frozen=True)
class Outcome:
    """What one command did: its exit status and what it printed."""

    code: int
    out: str
    err: str


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Outcome:
    """``main(argv)`` with stdout and stderr captured."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def assert_one_error_line(outcome: Outcome, *fragments: str, code: int = 1) -> str:
    """The command failed with ``code`` and printed exactly one ``error:`` line holding every fragment."""
    assert outcome.code == code, outcome
    lines = outcome.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), outcome.err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]
