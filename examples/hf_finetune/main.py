"""LightningCLI entry point: fine-tune a Hugging Face causal LM with exact, token-budget split mode.

Install the extras (``transformers``, W&B, and jsonargparse for LightningCLI), then run from the repository root::

    pip install -e ".[hf,cli,report,wandb]"
    OMP_NUM_THREADS=1 python -m examples.hf_finetune.main fit --config examples/hf_finetune/configs/ddp_cpu.yaml
    OMP_NUM_THREADS=1 python examples/hf_finetune/main.py fit --config examples/hf_finetune/configs/ddp_cpu.yaml

W&B runs offline unless ``WANDB_MODE`` says otherwise (``WANDB_MODE=online`` after ``wandb login``; ``wandb sync``
uploads an offline run later), and the Hugging Face Hub is never reached (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so that `examples.hf_finetune` resolves as under `-m`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Before wandb and transformers read them; a value the user set wins. Lightning's `ddp` re-runs this command for
# the other ranks with the same environment.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from examples.hf_finetune.data import InstructionDataModule
from examples.hf_finetune.model import HFCausalLM


class FinetuneCLI(LightningCLI):
    """LightningCLI for :class:`HFCausalLM` on :class:`InstructionDataModule`; the model's sizes follow the data's.

    The probe builds what this CLI builds, links included:
    ``lightning-accum probe --cli examples.hf_finetune.main:FinetuneCLI --config examples/hf_finetune/configs/...``.
    """

    def __init__(
        self,
        model_class: type[LightningModule] = HFCausalLM,
        datamodule_class: type[LightningDataModule] = InstructionDataModule,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_class, datamodule_class, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One setting for both: the vocabulary holds every id the data draws, the positions cover its longest sequence.
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.max_length", "model.n_positions")


def main(args: ArgsType = None, run: bool = True) -> FinetuneCLI:
    """Build the CLI from ``args`` (``None``: ``sys.argv``), run its subcommand when ``run``, and return it."""
    return FinetuneCLI(args=args, run=run, seed_everything_default=0)


if __name__ == "__main__":
    main()
