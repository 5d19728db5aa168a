"""A PEFT LoRA model (frozen base) under both modes, on 1 process and on 2 DDP ranks.

A Hugging Face GPT-2 built from a config (nothing downloaded) wrapped by `peft.get_peft_model` with LoRA on its
attention projection: only the adapters train. Each optimizer step's LoRA gradient must be the one of a single
full-batch pass of the same PEFT model over the step's samples (its own token-mean loss), the base weights must not
move, and under DDP (which registers only the trainable parameters) both ranks must agree.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before transformers is imported

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler, AutoMicroBatching
from lightning_accum.items import CountTokens
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.sequences import PaddedSequences
from tests.test_huggingface import CausalLM, Sequences, collate, gpt2, model_loss

peft = pytest.importorskip("peft", reason="needs PEFT: pip install 'lightning-accum[peft]'")

LR = 0.1


def lora_gpt2() -> nn.Module:
    # `init_lora_weights=False`: random A *and* B, so both get a gradient at the first step (PEFT's default B = 0
    # gives A none, and a test of A's gradient would pass on zeros). GPT-2's `Conv1D` stores its weight transposed.
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True, init_lora_weights=False
    )
    return peft.get_peft_model(gpt2(), config)


def trainable(model: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class LoraLM(CausalLM):
    """The PEFT model; records the LoRA gradient and the samples of each optimizer step (window or split mode)."""

    def build(self) -> nn.Module:
        return lora_gpt2()

    def trained(self) -> dict[str, Tensor]:
        return trainable(self.model)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(trainable(self.model).values(), lr=LR)


class SaveRun(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: LoraLM) -> None:
        owner = next((cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching)), None)
        figures = {
            "step_grads": pl_module.step_grads,
            "step_indices": pl_module.step_indices,
            "state": {n: t.detach().clone() for n, t in pl_module.model.state_dict().items()},
            "oom_retries": owner.oom_retries if owner is not None else 0,
        }
        torch.save(figures, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def reference(initial: nn.Module, dataset: Sequences, windows: Sequence[Sequence[int]]) -> list[dict[str, Tensor]]:
    """Each step: one pass of the PEFT model over the step's samples (its own token mean), then SGD on the LoRA."""
    model = copy.deepcopy(initial)
    grads = []
    for window in windows:
        model.zero_grad(set_to_none=True)
        model_loss(model, collate([dataset[i] for i in window])).backward()
        grads.append({n: p.grad.detach().clone() for n, p in trainable(model).items()})
        with torch.no_grad():
            for n, p in trainable(model).items():
                p -= LR * grads[-1][n]
    return grads


COUNTER = CountTokens("labels", shift=1)  # GPT-2 shifts its labels inside (docs/huggingface.md)


def callback(mode: str, devices: int) -> pl.Callback:
    if mode == "window":
        return AccumulationScheduler(2, count_items=COUNTER)
    # Split by tokens: step batches of 8, sorted by length, cut at 24 padded tokens; under DDP with an OOM in the
    # backward of rank 1's second micro-batch of step 1, which re-runs that step on both ranks smaller.
    faults = [OOMFault(step=1, micro_batch=1, phase="backward", rank=1)] if devices == 2 else []
    return AutoMicroBatching(
        sequences=PaddedSequences(),
        micro_batch_tokens=24,
        pin_micro_batch_size=True,
        count_items=COUNTER,
        fault_injector=OOMInjector(faults),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.ddp)], ids=["1-process", "2-ddp-ranks"])
@pytest.mark.parametrize("mode", ["window", "tokens"])
def test_lora_update_is_one_full_batch_token_mean_and_the_base_is_frozen(tmp_path, mode, devices):
    split = mode == "tokens"
    # Window mode: micro-batches of 3, k=2; by tokens: step batches of 8. 2 optimizer steps per rank either way.
    dataset = Sequences((16 if split else 12) * devices, seed=3)
    model = LoraLM(split_mode=split)
    initial = copy.deepcopy(model.model)
    assert 0 < sum(p.numel() for p in trainable(initial).values()) < sum(p.numel() for p in initial.parameters())
    strategy: Any = h.ddp_strategy() if devices == 2 else "auto"
    trainer = h.make_trainer(
        tmp_path, [callback(mode, devices), SaveRun(str(tmp_path))], strategy=strategy, devices=devices
    )
    trainer.fit(model, DataLoader(dataset, batch_size=8 if split else 3, collate_fn=collate))

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    assert [len(r["step_grads"]) for r in ranks] == [2] * devices
    windows = [
        [i for rank in indices for i in rank] for indices in zip(*(r["step_indices"] for r in ranks), strict=True)
    ]
    expected = reference(initial, dataset, windows)
    for r in ranks:
        h.assert_grads_close(r["step_grads"], expected, **h.FP32)
    if devices == 2:
        h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
        if split:
            assert [r["oom_retries"] for r in ranks] == [1, 1]  # the fault struck on rank 1; both re-ran the step
    # The frozen base did not move, bit for bit; every LoRA tensor did.
    before = initial.state_dict()
    lora = set(trainable(initial))
    after = ranks[0]["state"]
    assert set(after) == set(before)
    for name, tensor in before.items():
        if name in lora:
            assert not torch.equal(after[name], tensor), f"{name} (LoRA) did not train"
        else:
            assert torch.equal(after[name], tensor), f"{name} (frozen base) moved"
