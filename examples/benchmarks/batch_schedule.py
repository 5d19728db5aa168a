"""Which k trains fastest on the clock: fixed k, a ramp, and AdaptiveBatchSize() with no argument (issue 39).

    OMP_NUM_THREADS=1 python examples/benchmarks/batch_schedule.py [--quick] [--settings a,b] [--seeds 0,1,2]
        [--variants "k=1;k=2;AdaptiveBatchSize()"] [--out DIR] [--plot PNG]

A benchmark, not a timed test. Two settings whose best fixed ``k`` differ:

* ``a``: one process, the byte-level char LM of ``examples/char_lm`` (micro-batches of 8 sequences, AdamW,
  ``CountTokens``, gradient clipping at 1.0 as in every setting): a step's fixed part is cheap next to a
  micro-batch's forward and backward.
* ``b``: 2 gloo DDP ranks (forked), a bag-of-tokens classifier with a wide embedding (``--vocab`` rows) over short
  sequences: every step all-reduces and updates the whole dense embedding gradient, so the step's fixed part is at
  least as long as a micro-batch's forward and backward.

Each runs fixed ``k`` in {1, 2, 4, 8, 16}, a ``BatchSizeRamp`` with ``lr_scaling="sqrt"``, ``AdaptiveBatchSize()``
(``AccumulationScheduler(AdaptiveBatchSize())``, nothing set: the learning rate follows the square root of the gain
ratio), ``AdaptiveBatchSize(lr_scaling=None)`` (the learning rate left alone, the default before) and
``AdaptiveBatchSize(objective="noise_scale")``, over the same samples (one epoch) from the same weights, for each
seed. Every run reports the held-out loss at equal samples (the end of the epoch) and, against a target loss fixed
in `TARGETS` before the runs, the training time (held-out probes excluded) and the optimizer steps to reach it.
Prints a markdown table (medians over seeds) and writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from examples.char_lm.data import IGNORE_INDEX, CharLMDataModule, collate_padded
from examples.char_lm.model import CharLM
from lightning_accum import AccumulationScheduler
from lightning_accum.items import CountTokens
from lightning_accum.schedules import AdaptiveBatchSize, BatchSizeRamp

FIXED_K = (1, 2, 4, 8, 16)
USED_IDS = 64  # the token ids setting b's data uses, of its `--vocab` embedding rows
TARGETS = {"a": 2.75, "b": 1.4}
"""The held-out loss each setting's runs race to, fixed before the runs reported in docs/noise-scale.md from a pilot
(the same benchmark without gradient clipping, run variant by variant): about where the good runs end."""


# ----------------------------------------------------------------------------------------------------------------
# the held-out probe: loss at points of equal samples, the clock without the probes
# ----------------------------------------------------------------------------------------------------------------
class Probe(pl.Callback):
    """The held-out loss every ``every`` samples (after the step that crosses it), with the training time so far.

    The time excludes the probes themselves. Under DDP every rank evaluates, and rank 0 writes what it saw to ``file``
    at the end (the ranks run in forked processes: the callback the caller holds sees none of it).
    """

    def __init__(self, loss: Callable[[pl.LightningModule], float], every: int, world_size: int, file: Path) -> None:
        self.loss, self.every, self.world_size, self.file = loss, every, world_size, file
        # (samples, steps, seconds, held-out loss, CPU seconds of this process: rank 0's)
        self.points: list[tuple[int, int, float, float, float]] = []
        self.samples, self._next, self._steps = 0, every, 0
        self._start, self._paused, self._cpu_start, self._cpu_paused = 0.0, 0.0, 0.0, 0.0

    def _record(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        pause, cpu_pause = time.perf_counter(), time.process_time()
        loss = self.loss(module)
        seconds, cpu = pause - self._start - self._paused, cpu_pause - self._cpu_start - self._cpu_paused
        self.points.append((self.samples, trainer.global_step, seconds, loss, cpu))
        self._paused += time.perf_counter() - pause
        self._cpu_paused += time.process_time() - cpu_pause

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._cpu_start = time.perf_counter(), time.process_time()
        self._record(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += _batch_size(batch) * self.world_size
        stepped, self._steps = trainer.global_step != self._steps, trainer.global_step
        if stepped and self.samples >= self._next:
            self._record(trainer, pl_module)
            while self._next <= self.samples:
                self._next += self.every

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.points[-1][0] != self.samples:
            self._record(trainer, pl_module)
        if trainer.global_rank == 0:
            owner = next(cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler))  # type: ignore[attr-defined]
            ks = (
                [owner.engine.schedule.k]
                if not owner.events
                else [owner.events[0].before, *(e.after for e in owner.events)]
            )
            changes = [(e.step, e.after) for e in owner.events]  # from this optimizer step on, k is `after`
            record = {"points": self.points, "steps": trainer.global_step, "k": ks, "changes": changes}
            self.file.write_text(json.dumps(record))


def _batch_size(batch: Any) -> int:
    return int((batch["labels"] if isinstance(batch, dict) else batch[0]).shape[0])


# ----------------------------------------------------------------------------------------------------------------
# setting a: the char LM, one process
# ----------------------------------------------------------------------------------------------------------------
def char_lm_setting(args: argparse.Namespace) -> dict[str, Any]:
    n_train, n_val = (512, 128) if args.quick else (8192, 256)  # 8192: the issue's own char LM run
    dm = CharLMDataModule(
        batch_size=8, min_length=16, max_length=48, val_fraction=(n_val + 0.5) / (n_train + n_val),
        max_sequences=n_train + n_val, seed=0,
    )  # fmt: skip
    dm.setup("fit")
    val = collate_padded(dm.val_set.sequences)  # type: ignore[union-attr]

    def held_out(module: pl.LightningModule) -> float:
        module.eval()
        with torch.no_grad():
            logits = module(val["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), val["labels"].flatten(), ignore_index=IGNORE_INDEX)
        module.train()
        return float(loss)

    def build(seed: int) -> pl.LightningModule:
        pl.seed_everything(seed, verbose=False)
        return CharLM(max_length=48, d_model=64, n_layers=2, n_heads=4, lr=3e-3)

    def loader(seed: int) -> DataLoader[Any]:
        dm.seed = seed  # the training shuffle follows the seed; the split does not
        return dm.train_dataloader()

    return {
        "name": "a: char LM, 1 process",
        "build": build,
        "loader": loader,
        "held_out": held_out,
        "count_items": CountTokens(key="labels"),
        "micro_batch": 8,
        "world_size": 1,
        "samples": n_train,
    }


# ----------------------------------------------------------------------------------------------------------------
# setting b: a wide embedding on 2 gloo DDP ranks
# ----------------------------------------------------------------------------------------------------------------
class BagOfTokens(Dataset[dict[str, Tensor]]):
    """Short sequences of the first ``used`` token ids, labelled by a fixed random teacher over their mean (10 classes).

    The model's table has many more rows than the data uses (a large vocabulary, most of it rare): each step's dense
    embedding gradient is all-reduced and updated whole, while the data stays learnable from a few thousand samples.
    """

    def __init__(self, n: int, used: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, used, (n, length), generator=g)
        teacher = torch.randn(used, 10, generator=torch.Generator().manual_seed(1234))
        logits = teacher[self.tokens].mean(1) * 6.0
        # A noisy teacher (a real noise scale), sampled from the seeded generator: torch seeds its default one at
        # random in each process, so labels drawn from it made every run of the benchmark a different task.
        self.labels = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"tokens": self.tokens[i], "labels": self.labels[i]}


class WideEmbedding(pl.LightningModule):
    def __init__(self, vocab: int, dim: int = 64, lr: float = 3e-2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 10)
        self.lr = lr

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens).mean(1))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch["tokens"]), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def wide_embedding_setting(args: argparse.Namespace) -> dict[str, Any]:
    n_train = 1024 if args.quick else 8192
    train, val = BagOfTokens(n_train, USED_IDS, 8, seed=0), BagOfTokens(1024, USED_IDS, 8, seed=1)

    def held_out(module: pl.LightningModule) -> float:
        module.eval()
        with torch.no_grad():
            loss = F.cross_entropy(module(val.tokens), val.labels)
        module.train()
        return float(loss)

    def build(seed: int) -> pl.LightningModule:
        pl.seed_everything(seed, verbose=False)
        return WideEmbedding(args.vocab)

    def loader(seed: int) -> DataLoader[Any]:
        return DataLoader(train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed))

    return {
        "name": f"b: wide embedding ({args.vocab} x 64), 2 DDP ranks",
        "build": build,
        "loader": loader,
        "held_out": held_out,
        "count_items": None,
        "micro_batch": 8,
        "world_size": 2,
        "samples": n_train,
    }


# ----------------------------------------------------------------------------------------------------------------
# one run, the variants, the table
# ----------------------------------------------------------------------------------------------------------------
def variants(setting: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    per_micro_step = setting["micro_batch"] * setting["world_size"]
    ramp_samples = setting["samples"] // 2
    found: dict[str, Callable[[], Any]] = {f"k={k}": (lambda k=k: k) for k in FIXED_K}
    found["ramp 1 -> 16, sqrt LR"] = lambda: BatchSizeRamp(
        per_micro_step, 16 * per_micro_step, per_micro_step * 3, ramp_samples, lr_scaling="sqrt"
    )
    found["AdaptiveBatchSize()"] = AdaptiveBatchSize
    found["AdaptiveBatchSize(lr_scaling=None)"] = lambda: AdaptiveBatchSize(lr_scaling=None)
    found["AdaptiveBatchSize(objective='noise_scale')"] = lambda: AdaptiveBatchSize(objective="noise_scale")
    return found


def chosen(found: dict[str, Callable[[], Any]], names: str) -> dict[str, Callable[[], Any]]:
    """The variants of ``found`` that ``names`` lists (``;``-separated, as the table names them), all where empty.

    Raises:
        ValueError: a name that is not a variant, with the ones there are.
    """
    if not names:
        return found
    wanted = [name.strip() for name in names.split(";")]
    unknown = [name for name in wanted if name not in found]
    if unknown:
        raise ValueError(f"--variants: no variant named {unknown}; the variants are {'; '.join(found)}.")
    return {name: found[name] for name in wanted}


def run(setting: dict[str, Any], schedule: Any, seed: int, out: Path) -> dict[str, Any]:
    world = setting["world_size"]
    file = out / "run.json"
    file.unlink(missing_ok=True)
    # Every 256 samples in both settings: how finely the time to the target is read.
    probe = Probe(setting["held_out"], every=max(64, setting["samples"] // 32), world_size=world, file=file)
    strategy: Any = "auto" if world == 1 else DDPStrategy(start_method="fork", process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
        callbacks=[AccumulationScheduler(schedule, count_items=setting["count_items"]), probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out,
    )  # fmt: skip
    model = setting["build"](seed)
    start = time.perf_counter()
    trainer.fit(model, setting["loader"](seed))
    result: dict[str, Any] = json.loads(file.read_text())
    result["seconds"] = time.perf_counter() - start
    return result


WALL, CPU = 2, 4
"""Where a probe's point holds the wall-clock training time, and rank 0's CPU time."""


def reach(points: Sequence[Sequence[float]], target: float, clock: int = WALL) -> tuple[float, float]:
    """The training seconds on ``clock`` and the optimizer steps at the first probe at or below ``target`` (nan: never).

    Points recorded before the CPU time was (four figures a point) have no ``CPU`` clock: nan.
    """
    for point in points:
        if point[3] <= target:
            return (float(point[clock]) if clock < len(point) else math.nan), float(point[1])
    return math.nan, math.nan


PRICED = -1
"""Not a probe's clock: the steps to the target priced by `step_price` (`priced_reach`)."""


def step_price(results: dict[str, list[dict[str, Any]]]) -> tuple[float, float]:
    """``(s, c)`` of a step's wall time ``s + k·c``, fitted (least squares) to the fixed ``k`` runs' mean step times.

    Each fixed run's mean step time is its training time over its optimizer steps, whole epoch; the median over seeds
    is fitted. A steadier clock than one run's time to the target, which the machine's load moves by 20% and more.
    """
    ks, times = [], []
    for variant, runs in results.items():
        if variant.startswith("k="):
            ks.append(float(variant[2:]))
            times.append(statistics.median(r["points"][-1][2] / r["points"][-1][1] for r in runs))
    mean_k, mean_t = statistics.fmean(ks), statistics.fmean(times)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, times, strict=True)) / sum(
        (k - mean_k) ** 2 for k in ks
    )
    return mean_t - slope * mean_k, slope


def priced_reach(run: dict[str, Any], target: float, price: tuple[float, float]) -> float:
    """The seconds to ``target`` if each optimizer step of ``run``'s ``k`` path cost ``s + k·c`` (nan: never).

    ``run["changes"]`` gives the steps where ``k`` changed; a run recorded without them prices only a constant ``k``.
    """
    steps = reach(run["points"], target)[1]
    changes = run.get("changes", [] if len(run["k"]) == 1 else None)
    if math.isnan(steps) or changes is None:
        return math.nan
    overhead, per_micro_batch = price
    k, seconds, upcoming = run["k"][0], 0.0, list(changes)
    for step in range(int(steps)):
        while upcoming and upcoming[0][0] <= step:
            k = upcoming.pop(0)[1]
        seconds += overhead + k * per_micro_batch
    return seconds


def seconds_to(run: dict[str, Any], target: float, clock: int, price: tuple[float, float] | None = None) -> float:
    """``run``'s time to ``target`` on ``clock``: `WALL`, `CPU`, or `PRICED` (by ``price``, `step_price`'s)."""
    if clock == PRICED:
        return math.nan if price is None else priced_reach(run, target, price)
    return reach(run["points"], target, clock)[0]


def best_fixed(
    results: dict[str, list[dict[str, Any]]], target: float, clock: int = WALL, price: tuple[float, float] | None = None
) -> str:
    """The fixed ``k`` whose median time to ``target`` is shortest, among those that reach it in the most seeds."""

    def rank(variant: str) -> tuple[int, float]:
        times = [seconds_to(r, target, clock, price) for r in results[variant]]
        reached = [t for t in times if math.isfinite(t)]
        return len(times) - len(reached), statistics.median(reached) if reached else math.inf

    return min((v for v in results if v.startswith("k=")), key=rank)


def paired_ratio(
    results: dict[str, list[dict[str, Any]]],
    variant: str,
    best: str,
    target: float,
    clock: int = WALL,
    price: tuple[float, float] | None = None,
) -> float:
    """The median over seeds of ``variant``'s time to ``target`` over ``best``'s in the same seed (nan: one never).

    Each seed runs every variant in turn, so a ratio within a seed sees the machine's load alike on both sides.
    """
    ratios = [
        seconds_to(mine, target, clock, price) / seconds_to(theirs, target, clock, price)
        for mine, theirs in zip(results[variant], results[best], strict=True)
    ]
    return math.nan if any(math.isnan(r) for r in ratios) else statistics.median(ratios)


def table(name: str, results: dict[str, list[dict[str, Any]]], target: float) -> str:
    """Medians over seeds, and each run's time to target over the best fixed ``k``'s: wall clock, CPU, priced."""
    price = step_price(results)
    clocks = (WALL, CPU, PRICED)
    best = {clock: best_fixed(results, target, clock, price) for clock in clocks}
    lines = [
        f"**{name}**, target held-out loss {target} (median of {len(next(iter(results.values())))} seeds; a step"
        f" priced at {price[0] * 1e3:.3g} ms + k x {price[1] * 1e3:.3g} ms)",
        "",
        f"| run | held-out loss at equal samples | time to target (s) | / {best[WALL]}'s, paired by seed | CPU time to"
        f" target (s) | / {best[CPU]}'s | priced steps to target (s) | / {best[PRICED]}'s | steps to target"
        " | train time (s) | k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for variant, runs in results.items():
        final = statistics.median(r["points"][-1][3] for r in runs)
        cells = []
        for clock in clocks:
            if clock == PRICED and any("changes" not in r and len(r["k"]) > 1 for r in runs):
                cells += ["n/a", "n/a"]  # recorded before the steps of each change were
                continue
            seconds = _median_or_never([seconds_to(r, target, clock, price) for r in runs])
            cells += [seconds, f"{paired_ratio(results, variant, best[clock], target, clock, price):.2f}"]
        steps = _median_or_never([reach(r["points"], target)[1] for r in runs])
        train = statistics.median(r["points"][-1][2] for r in runs)
        paths = "; ".join(" → ".join(str(k) for k in r["k"]) for r in runs)  # each seed's path of k
        lines.append(f"| {variant} | {final:.3f} | {' | '.join(cells)} | {steps} | {train:.1f} | {paths} |")
    return "\n".join(lines)


def _median_or_never(values: Sequence[float]) -> str:
    """The median, or how many seeds never reached the target."""
    reached = [v for v in values if math.isfinite(v)]
    if len(reached) < len(values):
        return f"{len(values) - len(reached)} of {len(values)} never"
    return f"{statistics.median(reached):.3g}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and one seed: a smoke run in a minute")
    parser.add_argument("--settings", default="a,b", help="which settings to run: a, b or a,b")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default="", help='only these, ";"-separated: "k=1;k=2;AdaptiveBatchSize()"')
    parser.add_argument("--vocab", type=int, default=32768, help="setting b's embedding rows (the data uses 64)")
    parser.add_argument("--out", default="/tmp/lightning_accum_batch_schedule")
    parser.add_argument("--plot", type=Path, help="draw the held-out loss by samples and by training time here (png)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")][:1] if args.quick else [int(s) for s in args.seeds.split(",")]
    builders = {"a": char_lm_setting, "b": wide_embedding_setting}
    report: dict[str, Any] = {}
    for key in args.settings.split(","):
        setting = builders[key](args)
        results: dict[str, list[dict[str, Any]]] = {}
        # Seed by seed, every variant in turn: a machine whose load drifts slows every variant alike.
        for seed in seeds:
            for variant, make in chosen(variants(setting), args.variants).items():
                result = run(setting, make(), seed, out)
                results.setdefault(variant, []).append(result)
                print(
                    f"{key} {variant} seed {seed}: {result['points'][-1][3]:.3f}, {result['seconds']:.1f} s", flush=True
                )
        text = table(setting["name"], results, TARGETS[key])
        print(text, flush=True)
        report[key] = {"name": setting["name"], "target": TARGETS[key], "results": results, "table": text}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    if args.plot is not None:
        plot(report, args.plot)
        print(f"wrote {args.plot}", flush=True)


def plot(report: dict[str, Any], path: Path) -> None:
    """Per setting: the held-out loss by samples seen and by training time, the first seed's run of every variant.

    The target loss each time to target is read at is a dotted line; the adaptive schedule is drawn thick.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.2 * len(report)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(report), 2, squeeze=False)
    for (by_samples, by_time), setting in zip(axes, report.values(), strict=True):
        for i, (variant, runs) in enumerate(setting["results"].items()):
            points = runs[0]["points"]  # (samples, steps, seconds, held-out loss)
            style = {"color": f"C{i}", "lw": 2.4 if variant == "AdaptiveBatchSize()" else 1.0, "label": variant}
            by_samples.plot([p[0] for p in points], [p[3] for p in points], **style)
            by_time.plot([p[2] for p in points], [p[3] for p in points], **style)
        for ax, label in ((by_samples, "samples seen (all ranks)"), (by_time, "training time (s)")):
            ax.axhline(setting["target"], color="0.5", ls=":", lw=1)
            ax.set(xlabel=label, ylabel="held-out loss", title=setting["name"])
        by_time.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
