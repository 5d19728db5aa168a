"""LightningCLI entry point for the byte-level language model.

Run from the repository root::

    python -m examples.char_lm.main fit --config examples/char_lm/configs/window_ramp.yaml
    python examples/char_lm/main.py fit --config examples/char_lm/configs/window_ramp.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so that `examples.char_lm` resolves as under `-m`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from examples.char_lm.data import CharLMDataModule
from examples.char_lm.model import CharLM


class CharLMCLI(LightningCLI):
    """LightningCLI for :class:`CharLM` on :class:`CharLMDataModule`; the model's ``max_length`` follows the data's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One setting for both, so positions always cover the longest sequence the data can yield.
        parser.link_arguments("data.max_length", "model.max_length")


def main(args: ArgsType = None, run: bool = True) -> CharLMCLI:
    """Build the CLI from ``args`` (``None``: ``sys.argv``), run its subcommand when ``run``, and return it."""
    return CharLMCLI(CharLM, CharLMDataModule, args=args, run=run, seed_everything_default=0)


if __name__ == "__main__":
    main()
