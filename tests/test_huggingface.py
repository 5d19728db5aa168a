"""A real Hugging Face causal LM (GPT-2 built from a config, nothing downloaded) under both modes and DDP.

GPT-2 shifts its labels inside the model: the loss at position t is for label t + 1, so its loss averages over
``labels[..., 1:] != -100``. Every test compares against the model's own ``outputs.loss`` on the concatenated batch.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before transformers is imported

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import tests.helpers as h
from lightning_accum import AccumulationScheduler, AutoMicroBatching
from lightning_accum.items import CountTokens

VOCAB = 64
MAX_LEN = 12
PAD_ID = 0
LR = 0.1


class Sequences(Dataset):
    """Token sequences of random lengths (2 to ``MAX_LEN``), unpadded; `collate` pads them on the right."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, MAX_LEN + 1, (n,), generator=g).tolist()
        self.ids = [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "index": torch.tensor(i)}


def collate(samples: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right padding to the longest sequence; labels are the input ids, -100 on padding (the model shifts them)."""
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        attention_mask[row, : len(sample["input_ids"])] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    index = torch.stack([s["index"] for s in samples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "index": index}


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    # No dropout, so that the run and the reference see the same function.
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=MAX_LEN, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=PAD_ID, eos_token_id=PAD_ID,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def model_loss(model: GPT2LMHeadModel, batch: dict[str, Tensor]) -> Tensor:
    """The model's own loss: a mean over the labels it keeps after shifting them."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


class CausalLM(pl.LightningModule):
    """Wraps the GPT-2; records the gradient and the samples of each optimizer step (window or split mode)."""

    def __init__(self, split_mode: bool = False) -> None:
        super().__init__()
        self.model = self.build()
        self.split_mode = split_mode
        self.step_grads: list[dict[str, Tensor]] = []
        self.step_indices: list[list[int]] = []
        self._window: list[int] = []

    def build(self) -> nn.Module:
        """The wrapped model (a subclass wraps another, e.g. a PEFT one)."""
        return gpt2()

    def trained(self) -> dict[str, Tensor]:
        """The parameters the optimizer steps, by name: the ones whose gradients the model records."""
        return dict(self.model.named_parameters())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if not self.split_mode:
            self._window.extend(batch["index"].tolist())
        return model_loss(self.model, batch)

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.split_mode:
            self._window = batch["index"].tolist()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.step_grads.append({n: p.grad.detach().clone() for n, p in self.trained().items()})
        self.step_indices.append(self._window)
        self._window = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(initial: CausalLM, dataset: Sequences, windows: Sequence[Sequence[int]]) -> list[dict[str, Tensor]]:
    """The exact gradients along the run: each step, one pass of the model over the step's samples, then SGD."""
    model = copy.deepcopy(initial.model)
    grads = []
    for window in windows:
        model.zero_grad(set_to_none=True)
        model_loss(model, collate([dataset[i] for i in window])).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= LR * grads[-1][n]
    return grads


def relative_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    a = torch.cat([actual[n].flatten() for n in expected])
    e = torch.cat([expected[n].flatten() for n in expected])
    return float((a - e).norm() / e.norm())


def counter_warnings(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "CountTokens" in str(w.message)]


def fit(tmp_path: Any, callback: pl.Callback, dataset: Sequences, batch_size: int, split_mode: bool) -> Any:
    model = CausalLM(split_mode=split_mode)
    initial = copy.deepcopy(model)
    trainer = h.make_trainer(tmp_path, [callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(dataset, batch_size=batch_size, collate_fn=collate))
    return model.step_grads, reference(initial, dataset, model.step_indices), counter_warnings(caught)


# ---- the silent error, and the fix ----------------------------------------------------------------------------------


def window_run(tmp_path: Any, counter: CountTokens) -> tuple[list[Any], list[Any], list[str]]:
    # 14 sequences, micro-batches of 3, k=2: windows of 2, 2 and 1 micro-batches holding different token counts.
    return fit(tmp_path, AccumulationScheduler(2, count_items=counter), Sequences(14), batch_size=3, split_mode=False)


def split_run(tmp_path: Any, counter: CountTokens) -> tuple[list[Any], list[Any], list[str]]:
    # Step batches of 8 cut into micro-batches of 3, 3 and 2; 16 sequences, so 2 steps.
    callback = AutoMicroBatching(3, pin_micro_batch_size=True, count_items=counter)
    return fit(tmp_path, callback, Sequences(16, seed=1), batch_size=8, split_mode=True)


def token_run(tmp_path: Any, counter: CountTokens) -> tuple[list[Any], list[Any], list[str]]:
    # Split by tokens: step batches of 8, sorted by length, cut at 24 padded tokens, each trimmed to its longest.
    from lightning_accum.sequences import PaddedSequences

    callback = AutoMicroBatching(
        sequences=PaddedSequences(), micro_batch_tokens=24, pin_micro_batch_size=True, count_items=counter
    )
    return fit(tmp_path, callback, Sequences(16, seed=1), batch_size=8, split_mode=True)


RUNS = {"window": window_run, "split": split_run, "tokens": token_run}


@pytest.mark.parametrize("mode", list(RUNS))
def test_counting_every_label_is_wrong_for_a_model_that_shifts_and_warns_once(tmp_path, mode):
    # The README's recipe before this fix: `CountTokens("labels")` counts position 0, which GPT-2's loss never sees.
    grads, expected, warned = RUNS[mode](tmp_path, CountTokens("labels"))
    errors = [relative_error(g, e) for g, e in zip(grads, expected, strict=True)]
    assert max(errors) > 1e-2, errors  # measured: window 1.4%, 4.1%, 2.0%; split 6.5%, 6.9%
    assert len(warned) == 1 and "`shift=1`" in warned[0] and "equal to the batch's `input_ids`" in warned[0]


@pytest.mark.parametrize("mode", list(RUNS))
def test_shift_1_counts_what_the_model_averages_over_and_is_exact(tmp_path, mode):
    grads, expected, warned = RUNS[mode](tmp_path, CountTokens("labels", shift=1))
    assert len(grads) == (3 if mode == "window" else 2)  # split and tokens: 2 step batches
    h.assert_grads_close(grads, expected, **h.FP32)
    assert warned == []


# ---- DDP: 2 gloo ranks ----------------------------------------------------------------------------------------------


class SaveSteps(pl.Callback):
    """Saves each rank's step gradients and samples to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: CausalLM) -> None:
        figures = {"step_grads": pl_module.step_grads, "step_indices": pl_module.step_indices}
        owner = next((cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching)), None)
        figures["oom_retries"] = owner.oom_retries if owner is not None else 0
        torch.save(figures, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["window", "split", "tokens", "tokens, overlap, OOM on rank 1"])
def test_shift_1_is_exact_under_ddp(tmp_path, mode):
    # Window mode: 7 sequences per rank in micro-batches of 3, k=2 (windows of 2 and 1). Split mode: a step batch of
    # 8 on each rank, micro-batches of 3; by tokens, cut at 24 padded tokens, so the ranks' step batches of other
    # lengths run other numbers of micro-batches. The ranks hold different token counts. The last: by tokens with
    # overlapped gradient sync, and an OOM in the backward of rank 1's second micro-batch of step 1, which re-runs
    # that step on both ranks at a smaller budget.
    from lightning_accum.memory.oom import OOMFault, OOMInjector
    from lightning_accum.sequences import PaddedSequences

    split = mode != "window"
    dataset = Sequences(32 if split else 14, seed=2)
    counter = CountTokens("labels", shift=1)
    callbacks = {
        "window": lambda: AccumulationScheduler(2, count_items=counter),
        "split": lambda: AutoMicroBatching(3, pin_micro_batch_size=True, count_items=counter),
        "tokens": lambda: AutoMicroBatching(
            sequences=PaddedSequences(), micro_batch_tokens=24, pin_micro_batch_size=True, count_items=counter
        ),
        "tokens, overlap, OOM on rank 1": lambda: AutoMicroBatching(
            sequences=PaddedSequences(),
            micro_batch_tokens=24,
            pin_micro_batch_size=True,
            count_items=counter,
            gradient_sync="overlap",
            fault_injector=OOMInjector([OOMFault(step=1, micro_batch=1, phase="backward", rank=1)]),
        ),
    }
    callback = callbacks[mode]()
    model = CausalLM(split_mode=split)
    initial = copy.deepcopy(model)
    strategy = h.ddp_strategy()
    trainer = h.make_trainer(tmp_path, [callback, SaveSteps(str(tmp_path))], strategy=strategy, devices=2)
    trainer.fit(model, DataLoader(dataset, batch_size=8 if split else 3, collate_fn=collate))

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [len(r["step_grads"]) for r in ranks] == [2, 2]
    if "OOM" in mode:
        assert [r["oom_retries"] for r in ranks] == [1, 1]  # the fault struck on rank 1; both re-ran the step
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    tokens = [sum(len(dataset.ids[i]) for i in r["step_indices"][0]) for r in ranks]
    assert tokens[0] != tokens[1], "the ranks must hold different token counts for this test to bite"
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    h.assert_grads_close(ranks[0]["step_grads"], reference(initial, dataset, windows), **h.FP32)
