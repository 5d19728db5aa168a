"""The main job: train the example language model in split mode and show what accumulation did.

    python3 -m pip install tox && python3 -m tox -e demo
    # or, in an environment with lightning-accum[wandb,report]:
    python examples/demo.py [--steps 60] [--output-dir demo_output] [--no-simulated-oom]

A byte-level transformer (examples/char_lm) learns from Python's own documentation topics. The dataloader yields
step batches of 64 padded sequences; ``AutoMicroBatching`` cuts each into the largest micro-batches that stay under a
deliberately tight memory budget, and ``AccumulationMonitor`` logs the effective batch, micro-batch, accumulation
steps, items (loss-bearing bytes) per step, peak memory, OOM recoveries and throughput to W&B (offline) and CSV.
One out-of-memory error is simulated mid-run so that the recovery shows on the dashboard: the step is re-run in
smaller pieces and nothing is lost. At the end the script draws the report and says how to sync the run and build
the W&B dashboard.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("WANDB_MODE", "offline")  # nothing here talks to W&B's servers
os.environ.setdefault("WANDB_SILENT", "true")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, WandbLogger  # noqa: E402

from examples.char_lm.data import CharLMDataModule  # noqa: E402
from examples.char_lm.model import CharLM  # noqa: E402
from lightning_accum import AccumulationMonitor, AutoMicroBatching  # noqa: E402
from lightning_accum.items import CountTokens  # noqa: E402
from lightning_accum.memory.backends import backend_for  # noqa: E402
from lightning_accum.memory.oom import OOMFault, OOMInjector  # noqa: E402
from lightning_accum.memory.sizes import format_size, format_sizes  # noqa: E402

STEP_BATCH = 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60, a few minutes on CPU)")
    parser.add_argument("--output-dir", default="demo_output", help="where the W&B run, CSV and report go")
    parser.add_argument(
        "--headroom-mib",
        type=int,
        default=200,
        help="on CPU, the memory budget above the resident set at start (default 200 MiB: the whole step batch"
        " needs more, so it is split)",
    )
    parser.add_argument("--no-simulated-oom", action="store_true", help="don't simulate the mid-run OOM")
    parser.add_argument("--project", default="lightning-accum-demo", help="W&B project name for the offline run")
    args = parser.parse_args(argv)

    output = Path(args.output_dir).resolve()
    output.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)

    data = CharLMDataModule(batch_size=STEP_BATCH, max_length=128, seed=0)
    model = CharLM(d_model=128, n_layers=4, n_heads=4, lr=3e-3, max_length=128)
    accelerator = "gpu" if _cuda() else "cpu"
    if accelerator == "cpu":
        # Tight on purpose: the budget is the memory in use now plus a little, so the step batch does not fit whole.
        budget: float | int = backend_for("cpu").current_bytes() + args.headroom_mib * 2**20
        budget_text = f"{format_size(budget)} resident ({args.headroom_mib} MiB above the start)"
    else:
        budget = 0.8
        budget_text = "80% of GPU memory"
    oom_step = max(1, args.steps // 2)
    injector = None if args.no_simulated_oom else OOMInjector(OOMFault(step=oom_step, micro_batch=0, phase="backward"))
    splitter = AutoMicroBatching(
        "auto", max_memory=budget, count_items=CountTokens(key="labels"), grow_patience=10, fault_injector=injector
    )
    peaks = PeakLog(splitter)
    wandb_logger = WandbLogger(project=args.project, save_dir=str(output), offline=True, log_model=False)
    csv_logger = CSVLogger(str(output), name="csv")
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=[wandb_logger, csv_logger],
        log_every_n_steps=1,
        callbacks=[splitter, AccumulationMonitor(), peaks],
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(output),
        limit_val_batches=0,
    )
    print(f"\nlightning_accum demo: {args.steps} steps of {STEP_BATCH} sequences, memory budget {budget_text}")
    if injector is not None:
        print(f"an out-of-memory error is simulated in step {oom_step} to show the recovery\n")
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    elapsed = time.perf_counter() - started

    run_dir = Path(wandb_logger.experiment.dir).parent
    import wandb

    wandb.finish()
    last = splitter.last_step_report
    assert last is not None
    report = output / "report.png"
    from lightning_accum.cli.report import load_series, write_report

    write_report(load_series(str(run_dir)), str(report), title="lightning_accum demo (char LM, split mode)")

    print("\n--- what happened " + "-" * 60)
    print(f"trained {trainer.global_step} steps in {elapsed:.0f} s on {accelerator}")
    print(f"effective batch: {last.effective_batch_size} sequences per step, unchanged by memory")
    print(f"micro-batch now: {last.micro_batch_size} sequences, {last.accumulation_steps} per step")
    print(f"OOMs recovered: {splitter.oom_retries}")
    print(peaks.summary())
    print(f"\nW&B offline run: {run_dir}")
    print(f"CSV metrics:     {csv_logger.log_dir}/metrics.csv")
    print(f"report plot:     {report}")
    wandb_cli, accum_cli = _command("wandb"), _command("lightning-accum")
    print("\nTo see it in W&B:")
    print(f"  {wandb_cli} sync {run_dir}")
    print(f"  {accum_cli} dashboard --entity YOUR_ENTITY --project {args.project}")
    print("Or, offline, redraw the plot from the run:")
    print(f"  {accum_cli} report {run_dir} --output {report}")
    return 0


class PeakLog(pl.Callback):
    """Each step's micro-batch size and peak, as ``AutoMicroBatching`` measured them: to say where the peak was."""

    def __init__(self, splitter: AutoMicroBatching) -> None:
        self.splitter = splitter
        self.steps: list[tuple[int, int]] = []  # (micro-batch size, peak bytes) per optimizer step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        report = self.splitter.last_step_report
        if report is not None and report.peak_bytes is not None:
            self.steps.append((report.micro_batch_size, report.peak_bytes))

    def summary(self) -> str:
        """Where the run's peak was against the budget, and why a split-mode peak can pass the budget at all."""
        budget = self.splitter.planner.budget_bytes
        if budget is None or not self.steps:
            return "peak memory: not measured against a budget"
        over = [(step, b, peak) for step, (b, peak) in enumerate(self.steps) if peak > budget]
        worst = max(peak for _, peak in self.steps)
        if self.splitter.planner.budget_unreachable is not None:  # no micro-batch meets it: the planner says why
            return f"peak memory: {worst / budget:.0%} of the budget. {self.splitter.planner.budget_unreachable}"
        if not over:
            return f"peak memory: {worst / budget:.0%} of the budget at most, under it in every step"
        listed = ", ".join(f"{step} (micro-batch {b}, {peak / budget:.1%})" for step, b, peak in over)
        under = max((peak for _, peak in self.steps if peak <= budget), default=0)
        worst_text, budget_text = format_sizes(worst, budget)
        # A shrink decided after step s is reported with step s + 1, the first that runs the new size.
        shrunk_after = {e.step - 1 for e in self.splitter.events if e.kind == "shrink"}
        reacted = "; the planner shrank right after each of them" if all(s in shrunk_after for s, _, _ in over) else ""
        return (
            f"peak memory: {worst / budget:.1%} of the budget at worst ({worst_text} of {budget_text}), over it in"
            f" step{'s' if len(over) > 1 else ''} {listed}.\n"
            "  Split mode steers by each step's measured peak, so the steps in which it is still finding out what"
            f" fits (the first at the pre-flight's start, the first at a grown size) can pass the budget{reacted}."
            f" The other {len(self.steps) - len(over)} steps stayed under it (at most {under / budget:.1%}).\n"
            "  The budget is a target the planner steers to, not a cap: on CPU it is the resident set, of which the"
            " pre-flight's trace sees only the tensors. Keep `max_memory` below what the device can hold."
        )


def _command(name: str) -> str:
    """``name`` if it is on PATH, else its full path in this environment (e.g. tox's, which isn't activated)."""
    import shutil

    if shutil.which(name):
        return name
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
