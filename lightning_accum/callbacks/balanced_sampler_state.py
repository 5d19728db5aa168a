"""`BalancedSamplerState`: a run resumed mid-epoch trains on the step batches the uninterrupted run would have."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_accum.sequences.loaders import balanced_samplers, check_loader_lengths


class BalancedSamplerState(pl.Callback):
    """Saves how far into its epoch a `BalancedBatchSampler` is, and starts a resumed run at its next step batch.

    Lightning restarts a plain ``DataLoader`` at the start of its epoch on a mid-epoch resume (it restores the
    position only of a stateful loader's, such as ``torchdata``'s ``StatefulDataLoader``), so without this callback a
    resumed run trains again on the step batches it already trained on, and never on the rest of the epoch's. Every
    rank counts the same, so the resumed run continues the same global order at any world size. At the start of
    training it checks that each sampler holds one length for each sample of its DataLoader's dataset
    (`check_loader_lengths`).

    Example:
        >>> BalancedSamplerState().state_dict()
        {'epoch': 0, 'consumed': 0}
    """

    def __init__(self) -> None:
        self.epoch, self.consumed = 0, 0
        self._pending: tuple[int, int] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        samplers = balanced_samplers(trainer.train_dataloader)
        if not samplers:
            raise RuntimeError(
                "`BalancedSamplerState` found no `BalancedBatchSampler` in the train DataLoader. Pass"
                " `DataLoader(dataset, batch_sampler=BalancedBatchSampler(...))`, or drop the callback."
            )
        check_loader_lengths(trainer.train_dataloader)
        if self._pending is not None:
            for sampler in samplers:
                sampler.resume(*self._pending)
            self.epoch, self.consumed = self._pending
            self._pending = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:  # a new epoch, not the resumed one
            self.epoch, self.consumed = trainer.current_epoch, 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.consumed += 1  # before a checkpoint saved at this step: Lightning runs ModelCheckpoint's hooks last

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch, self.consumed = trainer.current_epoch + 1, 0

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = (int(state_dict["epoch"]), int(state_dict["consumed"]))
