"""Split mode by tokens against by samples, side by side in one run: samples per second, padding, peak memory, OOMs.

    OMP_NUM_THREADS=1 python examples/benchmarks/token_split.py [--repeats 5] [--steps 6] [--warmup 2] [--quick]

A causal LM of our own (pre-norm transformer blocks: causal self-attention through ``scaled_dot_product_attention``
with the padding mask, and an MLP; it shifts its labels inside, as Hugging Face causal LMs do) trains on step batches
of 64 right-padded sequences, every variant with the same largest micro-batch in padded token positions, 8 x 256:

- **log-normal lengths** (median 40, capped at 256, padded to 256 as ``padding="max_length"`` gives them):
  ``by samples``: today's split mode, ``AutoMicroBatching(8, pin_micro_batch_size=True)``, at the full padded width;
  ``sorted by hand``: the same, with a ``split_batch`` hook that sorts the step batch by length and trims each
  micro-batch of 8 to its longest sequence;
  ``by tokens``: ``AutoMicroBatching(sequences=PaddedSequences(), micro_batch_tokens=8 * 256,
  pin_micro_batch_size=True)``;
- **equal lengths** (every sequence 256 tokens, so there is nothing to sort or trim): ``by samples`` and
  ``by tokens``.

Every variant counts tokens (``CountTokens("labels", shift=1)``), runs under the same ``max_memory`` budget (the
resident set at the start plus ``--headroom-mib``) with `lightning_accum.AccumulationMonitor` logging every step, and
starts from the same weights on the same batches. The fits are interleaved (each repeat runs every variant once, in a
rotated order), so drift in the machine's load hits every variant alike; a ratio is the median over the repeats of the
ratio within a repeat, and its spread is their range. Samples per second are timed over the steps after ``--warmup``.
"Per step" is the median, over every timed step of every repeat, of the time ``by samples`` took for that step batch
over the time this variant took for it, with its quartiles: robust to a burst of the machine's other load that slows a
few steps of one fit. Padding is the share of the token positions the micro-batches computed that hold no real token;
peak is the monitor's ``memory/peak_gib`` (the peak resident set, reset every step), the maximum over the timed steps.
Parity compares every variant with ``by samples`` (the exact full-batch mean over the step's tokens), in the first
repeat: the largest relative difference ``max |a - b| / max |b|`` over the parameter tensors after the run, and over
every step's gradient (the sharper test: an update of lr x gradient is too small to show in float32 parameters near 1).
Both are 0 up to float summation order.

Ratios, not times, are the result: the machine is shared. The last line is ``RESULT`` and the results as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from examples.char_lm.model import Block
from lightning_accum import AccumulationMonitor, AutoMicroBatching
from lightning_accum.items import CountTokens
from lightning_accum.memory.backends import CPUBackend
from lightning_accum.memory.host import trim_cpu_heap
from lightning_accum.sequences import PaddedSequences

VOCAB = 256  # bytes
PAD_TO = 256  # the longest sequence, and what every step batch is padded to
STEP_BATCH = 64
MICRO_BATCH = 8
TOKENS = MICRO_BATCH * PAD_TO  # the largest micro-batch of every variant, in padded token positions
GIB = 2**30
# A Trainer that writes nothing: no logger, checkpoint, progress bar or model summary.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
CASES = {
    "log-normal lengths": ("by samples", "sorted by hand", "by tokens"),
    "equal lengths": ("by samples", "by tokens"),
}
BASELINE = "by samples"


# ---- data --------------------------------------------------------------------------------------------------------


def lognormal_lengths(n: int, seed: int = 0, median: float = 40.0, sigma: float = 0.8) -> list[int]:
    """Sequence lengths of very different sizes: log-normal around ``median``, between 2 and `PAD_TO`."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(n, generator=g) * sigma + math.log(median)).exp()
    return [int(v) for v in lengths.round().clamp(2, PAD_TO)]


class TokenSequences(Dataset):
    """Random token ids (1 to ``vocab - 1``; 0 is padding) of the given lengths, one tensor per sample."""

    def __init__(self, lengths: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Tensor:
        return self.samples[i]


def pad_right(samples: list[Tensor]) -> dict[str, Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding), right-padded to `PAD_TO`."""
    ids = torch.zeros(len(samples), PAD_TO, dtype=torch.long)
    mask = torch.zeros(len(samples), PAD_TO, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = sample
        mask[row, : len(sample)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sort_and_trim(batch: dict[str, Tensor], micro_batch_size: int) -> list[dict[str, Tensor]]:
    """A ``split_batch`` hook written by hand: longest first, micro-batches of ``micro_batch_size`` samples, each
    trimmed to its longest sequence."""
    lengths = batch["attention_mask"].sum(dim=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    micro_batches = []
    for start in range(0, len(order), micro_batch_size):
        rows = order[start : start + micro_batch_size]
        longest = int(lengths[rows[0]])
        micro_batches.append({key: value[rows, :longest] for key, value in batch.items()})
    return micro_batches


# ---- the model -----------------------------------------------------------------------------------------------------


class CausalLM(pl.LightningModule):
    """A small causal LM that shifts its labels inside and averages the cross-entropy over its loss-bearing tokens.

    Its blocks are `examples.char_lm.model.Block`s without dropout, attending to no padding. Records, for every step,
    the token positions its micro-batches computed, the real tokens among them, and the number of micro-batches.
    """

    def __init__(
        self, dim: int = 128, heads: int = 4, layers: int = 4, lr: float = 0.1, record_grads: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr, self.record_grads = lr, record_grads
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(PAD_TO, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.steps: list[list[int]] = []  # per step: [positions, real tokens, micro-batches]
        self.step_grads: list[dict[str, Tensor]] = []  # the exact window gradient of every step

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(self.norm(x))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.steps.append([0, 0, 0])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        step = self.steps[-1]
        step[0] += batch["input_ids"].numel()
        step[1] += int(batch["attention_mask"].sum())
        step[2] += 1
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.record_grads:
            self.step_grads.append({name: p.grad.detach().clone() for name, p in self.named_parameters()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ---- one fit -------------------------------------------------------------------------------------------------------


class StepClock(pl.Callback):
    """Wall time, samples and the monitor's peak over the steps after ``warmup``; the padding the callback reported."""

    def __init__(self, owner: AutoMicroBatching, warmup: int) -> None:
        self.owner, self.warmup = owner, warmup
        self.start = self.seconds = self.cpu_start = self.cpu_seconds = 0.0
        self.samples = 0
        self.peak_gib = 0.0
        self.reported_padding: list[float] = []  # the callback's `padding_fraction` of every step (by tokens)
        self.step_start = 0.0
        self.step_seconds: list[float] = []  # the wall time of each timed step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        # After the callback's and the monitor's own hooks: this step's report, and what the monitor logged for it.
        report, metrics = self.owner.last_step_report, trainer.callback_metrics
        if report is not None and report.padding_fraction is not None:
            self.reported_padding.append(report.padding_fraction)
        if trainer.global_step > self.warmup:
            self.step_seconds.append(time.perf_counter() - self.step_start)
            self.seconds = time.perf_counter() - self.start
            self.cpu_seconds = time.process_time() - self.cpu_start
            self.samples += len(batch["input_ids"])
            self.peak_gib = max(self.peak_gib, float(metrics["memory/peak_gib"]))


@dataclass
class Fit:
    """What one fit measured."""

    samples_per_sec: float
    samples_per_cpu_sec: float  # per second of this process's CPU time: what the machine's other load disturbs least
    step_seconds: list[float]  # the wall time of each timed step
    padding: float  # the share of the token positions computed that held no real token, over the whole fit
    step_padding: list[float]  # the same, per step
    reported_padding: list[float]  # the callback's `padding_fraction` per step (by tokens; empty otherwise)
    peak_gib: float  # the monitor's `memory/peak_gib`, the largest over the timed steps
    micro_batches: float  # per step, on average
    oom_retries: int
    parameters: dict[str, Tensor]  # after the fit
    step_grads: list[dict[str, Tensor]]


def callback_for(variant: str, budget: int) -> AutoMicroBatching:
    tokens = CountTokens("labels", shift=1)  # the model shifts its labels inside
    if variant == "by tokens":
        return AutoMicroBatching(
            sequences=PaddedSequences(mask="attention_mask"),
            micro_batch_tokens=TOKENS,
            pin_micro_batch_size=True,
            max_memory=budget,
            count_items=tokens,
        )
    split = sort_and_trim if variant == "sorted by hand" else None
    return AutoMicroBatching(
        MICRO_BATCH, pin_micro_batch_size=True, max_memory=budget, count_items=tokens, split_batch=split
    )


def fit(
    variant: str, dataset: TokenSequences, model_kwargs: dict[str, int], warmup: int, budget: int, record: bool
) -> Fit:
    """One fit of ``variant`` on ``dataset`` (one epoch of step batches), from the same weights as every other.

    With ``record``, it keeps the gradient of every step and the parameters after the fit.
    """
    model = CausalLM(**model_kwargs, record_grads=record)
    callback = callback_for(variant, budget)
    clock = StepClock(callback, warmup)
    monitor = AccumulationMonitor(logging_interval=1, progress_bar=False, summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[callback, monitor, clock],
        num_sanity_val_steps=0,
        **QUIET,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=STEP_BATCH, collate_fn=pad_right))
    positions, real, micro_batches = (sum(column) for column in zip(*model.steps, strict=True))
    return Fit(
        samples_per_sec=clock.samples / clock.seconds,
        samples_per_cpu_sec=clock.samples / clock.cpu_seconds,
        step_seconds=clock.step_seconds,
        padding=1 - real / positions,
        step_padding=[1 - r / p for p, r, _ in model.steps],
        reported_padding=clock.reported_padding,
        peak_gib=clock.peak_gib,
        micro_batches=micro_batches / len(model.steps),
        oom_retries=callback.oom_retries,
        parameters={name: p.detach().clone() for name, p in model.named_parameters()} if record else {},
        step_grads=model.step_grads,
    )


def relative_difference(values: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    """The largest relative difference of ``values`` from ``reference`` over the tensors: max |a - b| / max |b|."""
    return max(
        float((values[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)) for name, ref in reference.items()
    )


def gradient_difference(grads: list[dict[str, Tensor]], reference: list[dict[str, Tensor]]) -> float:
    """`relative_difference` of every step's gradient, the largest over the steps."""
    return max(relative_difference(g, r) for g, r in zip(grads, reference, strict=True))


def in_fresh_process(*args: Any) -> Fit:
    """`fit` in a child forked from this process: every fit starts from the same resident set and heap, so that no
    fit's peak holds what an earlier one left in the heap, and none pays for importing torch and Lightning again."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(fit, args)


# ---- the run -------------------------------------------------------------------------------------------------------


def datasets(steps: int, seed: int = 0) -> dict[str, TokenSequences]:
    n = STEP_BATCH * steps
    return {
        "log-normal lengths": TokenSequences(lognormal_lengths(n, seed=seed), seed=seed),
        "equal lengths": TokenSequences([PAD_TO] * n, seed=seed),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fit, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="steps per fit before the clock starts")
    parser.add_argument("--headroom-mib", type=int, default=256, help="the budget: the resident set at start + this")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 repeat of 2 steps: a smoke test")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 1, 1
    model_kwargs = {"dim": 32, "heads": 2, "layers": 2} if args.quick else {"dim": 128, "heads": 4, "layers": 4}
    data = datasets(args.warmup + args.steps)
    gc.collect()
    trim_cpu_heap()
    start = CPUBackend().current_bytes()
    budget = start + args.headroom_mib * 2**20
    print(
        f"model {model_kwargs}, step batch {STEP_BATCH} padded to {PAD_TO}, largest micro-batch {MICRO_BATCH} x"
        f" {PAD_TO} = {TOKENS} token positions; budget {budget / GIB:.2f} GiB resident (at start"
        f" {start / GIB:.2f} GiB + {args.headroom_mib} MiB); {args.repeats} interleaved repeats of"
        f" {args.warmup} + {args.steps} steps"
    )
    fits: dict[str, dict[str, list[Fit]]] = {case: {v: [] for v in variants} for case, variants in CASES.items()}
    for repeat in range(args.repeats):
        for case, variants in CASES.items():
            # Rotated, so that no variant always runs first (or right after the slowest).
            for variant in variants[repeat % len(variants) :] + variants[: repeat % len(variants)]:
                fits[case][variant].append(
                    in_fresh_process(variant, data[case], model_kwargs, args.warmup, budget, repeat == 0)
                )
    results = summarize(fits, budget)
    print_table(results)
    print("RESULT", json.dumps({"budget_gib": budget / GIB, "cases": results}))
    return results


def summarize(fits: dict[str, dict[str, list[Fit]]], budget: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Per case and variant: the median samples/s, the ratio to `BASELINE` (median and range of the paired ratios),
    padding, peak against the budget, OOMs and the parity with `BASELINE` (from the first repeat)."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for case, by_variant in fits.items():
        baseline = by_variant[BASELINE]
        results[case] = {}
        for variant, runs in by_variant.items():
            ratios = [r.samples_per_sec / b.samples_per_sec for r, b in zip(runs, baseline, strict=True)]
            cpu_ratios = [r.samples_per_cpu_sec / b.samples_per_cpu_sec for r, b in zip(runs, baseline, strict=True)]
            # The same step batch's time by `BASELINE` over this variant's, in the same repeat, for every timed step:
            # their median shrugs off a burst of the machine's other load that hits a few steps of one fit.
            step_ratios = sorted(
                b_step / r_step
                for r, b in zip(runs, baseline, strict=True)
                for r_step, b_step in zip(r.step_seconds, b.step_seconds, strict=True)
            )
            first = runs[0]
            results[case][variant] = {
                "samples_per_sec": statistics.median(r.samples_per_sec for r in runs),
                "ratio": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "ratios": ratios,
                "samples_per_cpu_sec": statistics.median(r.samples_per_cpu_sec for r in runs),
                "cpu_ratio": statistics.median(cpu_ratios),
                "cpu_ratio_range": [min(cpu_ratios), max(cpu_ratios)],
                "step_ratio": statistics.median(step_ratios),
                "step_ratio_quartiles": statistics.quantiles(step_ratios, n=4)[::2]
                if len(step_ratios) > 1
                else [step_ratios[0]] * 2,
                "padding": first.padding,
                "step_padding": first.step_padding,
                "reported_padding": first.reported_padding,
                "micro_batches": first.micro_batches,
                "peak_gib": max(r.peak_gib for r in runs),
                "peak_over_budget": max(r.peak_gib for r in runs) * GIB / budget,
                "oom_retries": sum(r.oom_retries for r in runs),
                "parameter_difference": relative_difference(first.parameters, baseline[0].parameters),
                "gradient_difference": gradient_difference(first.step_grads, baseline[0].step_grads),
            }
    return results


def print_table(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(
        "| case | variant | samples/s | vs by samples (range) | by CPU time (range) | per step (quartiles) | padding |"
        " micro-batches/step | peak / budget | OOMs | parameters (gradients) vs by samples |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, by_variant in results.items():
        for variant, r in by_variant.items():
            low, high = r["ratio_range"]
            cpu_low, cpu_high = r["cpu_ratio_range"]
            q1, q3 = r["step_ratio_quartiles"]
            print(
                f"| {case} | {variant} | {r['samples_per_sec']:.1f} | {r['ratio']:.2f}x ({low:.2f}-{high:.2f}) |"
                f" {r['cpu_ratio']:.2f}x ({cpu_low:.2f}-{cpu_high:.2f}) | {r['step_ratio']:.2f}x ({q1:.2f}-{q3:.2f}) |"
                f" {r['padding']:.1%} |"
                f" {r['micro_batches']:.1f} | {r['peak_gib']:.2f} GiB ({r['peak_over_budget']:.0%}) |"
                f" {r['oom_retries']} | {r['parameter_difference']:.1e} ({r['gradient_difference']:.1e}) |"
            )


if __name__ == "__main__":
    main()
