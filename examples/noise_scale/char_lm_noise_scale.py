"""The gradient noise scale on the char LM, and AdaptiveBatchSize against fixed k at equal samples seen.

    OMP_NUM_THREADS=1 python examples/noise_scale/char_lm_noise_scale.py \
        [--out /tmp/noise_scale] [--plot docs/images/noise_scale_char_lm.png] [--tiny]

Trains the byte-level LM of `examples/char_lm` once per variant, every run from the same initial weights on the same
samples in the same order (one epoch over the same training set, same seed):

* fixed ``k`` in ``--ks`` (``AccumulationScheduler(k)``), and
* ``AccumulationScheduler(AdaptiveBatchSize(...))``, which starts at ``--adaptive-min`` and raises ``k`` towards
  the measured noise scale.

Every run has ``AccumulationMonitor(gradient_noise_scale=True, logging_interval=1)`` and token-normalized windows
(``CountTokens``), so the noise scale is in loss-bearing bytes (items). The held-out loss (token-weighted, on a fixed
validation set) is probed at ``--probes`` points of equal samples seen, identical for every run.

Writes to ``--out``: ``results.json`` (every run's logged curves and the comparison rows), ``comparison.md`` (the
table) and, with ``--plot``, the figure. Prints the table. A run of the defaults takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so that `examples.char_lm` resolves as under `-m`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from examples.char_lm.data import IGNORE_INDEX, CharLMDataModule, collate_padded
from examples.char_lm.model import CharLM
from lightning_accum import AccumulationMonitor, AccumulationScheduler, keys
from lightning_accum.items import CountTokens
from lightning_accum.schedules import AdaptiveBatchSize

LOGGED = (
    keys.EFFECTIVE_BATCH_SIZE,
    keys.ACCUMULATION_STEPS,
    keys.ITEMS_PER_STEP,
    keys.WINDOW_LOSS,
    keys.GRADIENT_NOISE_SCALE,
    keys.GRAD_SQ_NORM,
    keys.GRAD_TRACE_COV,
)


class MemoryLogger(Logger):
    """Keeps every logged row in memory: ``rows[step] = {key: value}`` (the monitor logs one row per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row = self.rows.setdefault(int(step or 0), {})
        row.update({key: float(value) for key, value in metrics.items() if key in LOGGED})


class HeldOutProbe(pl.Callback):
    """The token-weighted held-out loss whenever the samples seen cross one of ``milestones`` (and at the end).

    The samples seen are counted from the batches, so every run is probed after the same samples, whatever its ``k``;
    a probe waits for the end of the window it falls in (the parameters only change at optimizer steps).
    """

    def __init__(self, batch: dict[str, Tensor], milestones: Sequence[int]) -> None:
        self.batch = batch
        self.milestones = sorted(milestones)
        self.samples = 0
        self.points: list[tuple[int, int, float]] = []  # (samples seen, optimizer steps, held-out loss)
        self._next = 0
        self._steps = 0

    def loss(self, model: CharLM) -> float:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(self.batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), self.batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        model.train(was_training)
        return float(loss)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.points.append((0, 0, self.loss(pl_module)))  # type: ignore[arg-type]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += int(batch["labels"].shape[0])
        stepped, self._steps = trainer.global_step != self._steps, trainer.global_step
        due = self._next < len(self.milestones) and self.samples >= self.milestones[self._next]
        if due and stepped:
            self.points.append((self.samples, trainer.global_step, self.loss(pl_module)))  # type: ignore[arg-type]
            while self._next < len(self.milestones) and self.samples >= self.milestones[self._next]:
                self._next += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.points[-1][0] != self.samples:
            self.points.append((self.samples, trainer.global_step, self.loss(pl_module)))  # type: ignore[arg-type]


def run_variant(name: str, schedule: Any, args: argparse.Namespace, dm: CharLMDataModule) -> dict[str, Any]:
    """Train one variant from the shared seed; its logged curves, its held-out probes and its summary row."""
    pl.seed_everything(args.seed, verbose=False)
    model = CharLM(
        max_length=args.max_length, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, lr=args.lr
    )
    logger = MemoryLogger()
    val_batch = collate_padded(dm.val_set.sequences)  # type: ignore[union-attr]
    n_train = len(dm.train_set)  # type: ignore[arg-type]
    probe = HeldOutProbe(val_batch, [round(n_train * (i + 1) / args.probes) for i in range(args.probes)])
    callbacks: list[pl.Callback] = [
        AccumulationScheduler(schedule, count_items=CountTokens(key="labels")),
        AccumulationMonitor(
            logging_interval=1,
            gradient_noise_scale=True,
            noise_scale_beta=args.beta,
            progress_bar=False,
            summary=False,
        ),
        probe,
    ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=callbacks,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - start

    steps = sorted(logger.rows)
    rows = [logger.rows[s] for s in steps]
    samples = _cumsum([row.get(keys.EFFECTIVE_BATCH_SIZE, math.nan) for row in rows])
    items = _cumsum([row.get(keys.ITEMS_PER_STEP, math.nan) for row in rows])
    curves = {
        "step": steps,
        "samples": samples,
        "items": items,
        "k": [row.get(keys.ACCUMULATION_STEPS, math.nan) for row in rows],
        "items_per_step": [row.get(keys.ITEMS_PER_STEP, math.nan) for row in rows],
        "window_loss": [row.get(keys.WINDOW_LOSS, math.nan) for row in rows],
        "noise_scale": [row.get(keys.GRADIENT_NOISE_SCALE, math.nan) for row in rows],
        "grad_sq_norm": [row.get(keys.GRAD_SQ_NORM, math.nan) for row in rows],
        "trace_cov": [row.get(keys.GRAD_TRACE_COV, math.nan) for row in rows],
    }
    ks = [int(k) for k in curves["k"] if math.isfinite(k)]
    final = probe.points[-1]
    summary = {
        "name": name,
        "k": f"{ks[0]}" if len(set(ks)) == 1 else f"{ks[0]} to {max(ks)}",
        "samples": final[0],
        "steps": trainer.global_step,
        "held_out_loss": final[2],
        "final_train_loss": _tail_mean(curves["window_loss"], samples, fraction=0.1),
        "seconds": seconds,
    }
    return {"summary": summary, "curves": curves, "probes": probe.points}


def _cumsum(values: Sequence[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _tail_mean(losses: Sequence[float], samples: Sequence[float], fraction: float) -> float:
    """The sample-weighted mean window loss over the last ``fraction`` of the samples (same samples for every run)."""
    if not samples:
        return math.nan
    cutoff = samples[-1] * (1 - fraction)
    pairs = [
        (loss, now - before)
        for loss, now, before in zip(losses, samples, [0.0, *samples[:-1]], strict=True)
        if now > cutoff
    ]
    weight = sum(w for _, w in pairs)
    return sum(loss * w for loss, w in pairs) / weight if weight else math.nan


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def describe_rise(run: dict[str, Any], fraction: float = 0.1) -> dict[str, float]:
    """Median noise scale and window loss over the first and the last ``fraction`` of the logged estimates."""
    curves = run["curves"]
    pairs = [
        (b, loss) for b, loss in zip(curves["noise_scale"], curves["window_loss"], strict=True) if math.isfinite(b)
    ]
    n = max(1, int(len(pairs) * fraction))
    head, tail = pairs[:n], pairs[-n:]
    return {
        "noise_scale_start": statistics.median(b for b, _ in head),
        "noise_scale_end": statistics.median(b for b, _ in tail),
        "loss_start": statistics.median(loss for _, loss in head),
        "loss_end": statistics.median(loss for _, loss in tail),
        "tokens_per_sequence": curves["items"][-1] / curves["samples"][-1],
    }


def table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| run | k | samples seen | optimizer steps | held-out loss | train loss (last 10%) | wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['name']} | {s['k']} | {s['samples']} | {s['steps']} | {s['held_out_loss']:.3f} |"
            f" {s['final_train_loss']:.3f} | {s['seconds']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: Mapping[str, dict[str, Any]], reference: str, adaptive: str, path: Path) -> None:
    """Four panels: the noise scale over training, against the loss, and the held-out loss by samples and by steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 8.5), layout="constrained")
    FigureCanvasAgg(figure)
    (ax_noise, ax_vs_loss), (ax_samples, ax_steps) = figure.subplots(2, 2)
    colors = {name: f"C{i}" for i, name in enumerate(runs)}

    ref = runs[reference]["curves"]
    for name, run in runs.items():  # every fixed-k run that measures (k >= 2), the reference run in full colour
        fixed_k = name.startswith("k=") and name != "k=1"
        if fixed_k:
            curves = run["curves"]
            ax_noise.plot(
                curves["samples"], curves["noise_scale"], color=colors[name], lw=2 if name == reference else 0.8,
                alpha=1.0 if name == reference else 0.6, label=f"B_noise, {name}",
            )  # fmt: skip
    ada = runs[adaptive]["curves"]
    ax_noise.step(
        ada["samples"], ada["items_per_step"], where="post", color=colors[adaptive], ls="--",
        label=f"tokens per step, {adaptive}",
    )  # fmt: skip
    per_micro_batch = statistics.median(i / k for i, k in zip(ref["items_per_step"], ref["k"], strict=True) if k > 0)
    for name in runs:
        if name.startswith("k="):
            k = int(name[2:])
            ax_noise.axhline(k * per_micro_batch, color="0.6", lw=0.6, ls=":")
            ax_noise.annotate(f"{name} batch", (ref["samples"][-1], k * per_micro_batch), fontsize=7, color="0.4",
                              ha="right", va="bottom")  # fmt: skip
    ax_noise.set_yscale("log")
    ax_noise.set_xlabel("samples seen")
    ax_noise.set_ylabel("tokens (items)")
    ax_noise.set_title("the gradient noise scale rises as the loss falls")
    loss_axis = ax_noise.twinx()
    loss_axis.plot(ref["samples"], _smooth(ref["window_loss"], 9), color="0.4", lw=1, label=f"window loss, {reference}")
    loss_axis.set_ylabel("window loss (nats/byte)")
    handles = ax_noise.get_legend_handles_labels()
    more = loss_axis.get_legend_handles_labels()
    ax_noise.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")

    for name, run in runs.items():
        curves = run["curves"]
        points = [
            (loss, b) for loss, b in zip(_smooth(curves["window_loss"], 9), curves["noise_scale"], strict=True) if b > 0
        ]
        if points:
            ax_vs_loss.plot(*zip(*points, strict=True), color=colors[name], label=name, lw=1)
    ax_vs_loss.set_yscale("log")
    ax_vs_loss.invert_xaxis()
    ax_vs_loss.set_xlabel("window loss (nats/byte, smoothed; falls to the right)")
    ax_vs_loss.set_ylabel("gradient noise scale (tokens)")
    ax_vs_loss.set_title("noise scale against the loss")
    ax_vs_loss.legend(fontsize=8)

    for name, run in runs.items():
        samples, steps, loss = zip(*run["probes"], strict=True)
        ax_samples.plot(samples, loss, marker=".", color=colors[name], label=name)
        ax_steps.plot([max(s, 1) for s in steps], loss, marker=".", color=colors[name], label=name)
    ax_samples.set_xlabel("samples seen")
    ax_samples.set_ylabel("held-out loss (nats/byte)")
    ax_samples.set_title("held-out loss at equal samples seen")
    ax_steps.set_xscale("log")
    ax_steps.set_xlim(left=min(max(p[1], 1) for run in runs.values() for p in run["probes"][1:]) / 1.5)
    ax_steps.set_xlabel("optimizer steps")
    ax_steps.set_ylabel("held-out loss (nats/byte)")
    ax_steps.set_title("held-out loss by optimizer steps")
    for axis in (ax_samples, ax_steps):
        low = min(p[2] for run in runs.values() for p in run["probes"])
        axis.set_ylim(low - 0.05, low + 1.0)
        axis.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def _smooth(values: Sequence[float], width: int) -> list[float]:
    """A centred moving average (shorter at the ends), ignoring non-finite values."""
    half = width // 2
    out = []
    for i in range(len(values)):
        window = _finite(values[max(0, i - half) : i + half + 1])
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lightning_accum_noise_scale", help="where results.json goes")
    parser.add_argument("--plot", default=None, help="write the figure here (PNG)")
    parser.add_argument("--ks", default="1,2,4,8", help="the fixed k to compare, comma-separated")
    parser.add_argument("--reference-k", type=int, default=4, help="the fixed-k run whose noise scale is reported")
    parser.add_argument("--train-sequences", type=int, default=4096, help="samples seen by every run (one epoch)")
    parser.add_argument("--val-sequences", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--max-length", type=int, default=48, help="bytes per sequence at most")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beta", type=float, default=0.95, help="noise-scale moving average, per window")
    parser.add_argument("--adaptive-min", type=int, default=2)
    parser.add_argument("--adaptive-max", type=int, default=16)
    parser.add_argument("--adaptive-warmup", type=int, default=50, help="windows before AdaptiveBatchSize moves k")
    parser.add_argument("--adaptive-beta", type=float, default=0.99, help="AdaptiveBatchSize's own moving average")
    parser.add_argument("--adaptive-factor", type=float, default=1.0, help="target global batch / noise scale")
    parser.add_argument("--allow-decrease", action="store_true", help="let AdaptiveBatchSize lower k again")
    parser.add_argument("--lr-scaling", default="none", choices=("none", "linear", "sqrt", "gain", "sqrt_gain"))
    parser.add_argument("--only", default="", help="run only these variants, comma-separated (e.g. k=2,adaptive)")
    parser.add_argument("--probes", type=int, default=8, help="held-out probes over the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a smoke test in seconds (not a measurement)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.train_sequences, args.val_sequences, args.max_length = 192, 32, 24
        args.d_model, args.n_layers, args.n_heads, args.probes = 16, 1, 2, 4
        args.ks, args.reference_k, args.adaptive_max, args.adaptive_warmup = "1,2,4", 2, 4, 2
    args.ks = [int(k) for k in str(args.ks).split(",")]
    if args.reference_k not in args.ks or args.reference_k < 2:
        parser.error(f"--reference-k must be one of --ks and >= 2 (a window of one measures nothing), got {args.ks}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.train_sequences + args.val_sequences
    dm = CharLMDataModule(
        batch_size=args.batch_size,
        min_length=16 if args.max_length >= 16 else 1,
        max_length=args.max_length,
        val_fraction=(args.val_sequences + 0.5) / n,  # int(n * fraction) == val_sequences, whatever the rounding
        max_sequences=n,
        seed=args.seed,
    )
    dm.setup("fit")

    lr_scaling = None if args.lr_scaling == "none" else args.lr_scaling
    variants: dict[str, Any] = {f"k={k}": k for k in args.ks}
    adaptive = "adaptive"
    variants[adaptive] = AdaptiveBatchSize(
        args.adaptive_min,
        args.adaptive_max,
        objective="noise_scale",
        factor=args.adaptive_factor,
        warmup_windows=args.adaptive_warmup,
        beta=args.adaptive_beta,
        lr_scaling=lr_scaling,
        allow_decrease=args.allow_decrease,
    )
    if args.only:
        variants = {name: v for name, v in variants.items() if name in args.only.split(",")}
    runs: dict[str, dict[str, Any]] = {}
    for name, schedule in variants.items():
        runs[name] = run_variant(name, schedule, args, dm)
        s = runs[name]["summary"]
        print(f"{name}: {s['steps']} steps, held-out loss {s['held_out_loss']:.3f}, {s['seconds']:.1f} s", flush=True)

    reference = f"k={args.reference_k}"
    rise = {name: describe_rise(runs[name]) for name in (reference, adaptive) if name in runs}
    summaries = [run["summary"] for run in runs.values()]
    results = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "train_sequences": len(dm.train_set),  # type: ignore[arg-type]
        "val_sequences": len(dm.val_set),  # type: ignore[arg-type]
        "rise": rise,
        "comparison": summaries,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=True))
    (out / "comparison.md").write_text(table(summaries) + "\n")
    print(table(summaries))
    for name, r in rise.items():
        print(
            f"{name}: noise scale {r['noise_scale_start']:.0f} -> {r['noise_scale_end']:.0f} tokens"
            f" (first/last 10% of estimates, median) while the window loss went {r['loss_start']:.3f} ->"
            f" {r['loss_end']:.3f}; {r['tokens_per_sequence']:.1f} tokens per sequence"
        )
    if args.plot and reference in runs and adaptive in runs:
        plot(runs, reference, adaptive, Path(args.plot))
        print(f"figure: {args.plot}")
    return results


if __name__ == "__main__":
    main()
