"""``lightning-accum report``: a PNG of the dashboard's panels from a real offline W&B run and from a CSV."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, AutoMicroBatching, keys
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.cli.main import main
from lightning_accum.cli.report import Series, build_figure, load_series, summarize, user_loss_keys, write_report
from lightning_accum.cli.report_summary import size_text
from lightning_accum.integrations.wandb import find_run_file, layout_keys, read_offline_run
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.monitor.rows import BUDGET_FRACTION
from tests.cli.helpers import assert_one_error_line, run_cli
from tests.helpers import IndexedDataset, RegressionModel, make_trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One real training run, logged to an offline W&B run and to a CSVLogger at once."""
    wandb = pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
    tmp_path = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(tmp_path))
        try:
            loggers = [WandbLogger(project="accum", save_dir=str(tmp_path)), CSVLogger(str(tmp_path), name="csv")]
            trainer = make_trainer(
                tmp_path,
                [AccumulationScheduler({0: 1, 2: 2}, unit="step"), AccumulationMonitor()],
                logger=loggers,
                max_epochs=2,
            )
            trainer.fit(RegressionModel(), DataLoader(IndexedDataset(40), batch_size=4))
            wandb.finish()
            assert read_offline_run(tmp_path / "wandb", wait_s=10).exit_code == 0  # the file is complete
        finally:
            wandb.teardown()
    return tmp_path, Path(loggers[1].log_dir) / "metrics.csv"


def test_report_from_an_offline_wandb_run(logged_run, tmp_path, capsys):
    run_dir, _ = logged_run
    output = tmp_path / "out" / "report.png"
    assert main(["report", str(run_dir / "wandb"), "--output", str(output)]) == 0
    summary = output.with_suffix(".txt")
    assert capsys.readouterr().out.splitlines()[-2:] == [f"wrote {output}", f"wrote {summary}"]
    data = output.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 50_000  # 12 drawn panels, not an empty canvas


def test_report_from_a_csv_logger_file(logged_run, tmp_path):
    _, csv_file = logged_run
    output = tmp_path / "csv.png"
    assert main(["report", str(csv_file), "--output", str(output), "--title", "from CSV"]) == 0
    assert output.read_bytes().startswith(PNG_MAGIC)


def test_wandb_and_csv_give_the_same_series(logged_run):
    run_dir, csv_file = logged_run
    from_wandb, from_csv = load_series(run_dir / "wandb"), load_series(csv_file.parent)
    drawn = [key for key in layout_keys() if from_wandb.get(key)]
    assert keys.EFFECTIVE_BATCH_SIZE in drawn and keys.EVENT_SCHEDULE_CHANGE in drawn
    for key in drawn:
        assert [s for s, _ in from_csv[key]] == [s for s, _ in from_wandb[key]], key
        assert [v for _, v in from_csv[key]] == pytest.approx([v for _, v in from_wandb[key]], rel=1e-6), key
    # The step schedule doubled k after two optimizer steps: 4, 4, then 8 samples per step.
    assert [v for _, v in from_wandb[keys.EFFECTIVE_BATCH_SIZE][:3]] == [4, 4, 8]


def test_report_errors_name_the_problem(tmp_path, capsys):
    outcome = run_cli(capsys, "report", str(tmp_path / "missing"), "--output", str(tmp_path / "x.png"))
    assert_one_error_line(outcome, "No W&B run at")
    other = tmp_path / "metrics.csv"
    other.write_text("step,val_loss\n1,0.5\n")
    outcome = run_cli(capsys, "report", str(other), "--output", str(tmp_path / "x.png"))
    assert_one_error_line(outcome, "holds none of the lightning_accum metrics")
    bad = tmp_path / "bad.csv"
    bad.write_text("epoch,loss\n0,1\n")
    assert_one_error_line(run_cli(capsys, "report", str(bad)), "has no `step` column")
    assert not (tmp_path / "x.png").exists()


# ---- --output: the file it prints is the file it wrote ------------------------------------------------------------


def test_output_without_a_suffix_is_written_as_the_png_it_prints(logged_run, tmp_path, capsys):
    _, csv_file = logged_run
    outcome = run_cli(capsys, "report", str(csv_file), "-o", str(tmp_path / "plots" / "report"))
    printed = [Path(line.removeprefix("wrote ")) for line in outcome.out.splitlines() if line.startswith("wrote ")]
    assert outcome.code == 0 and printed == [tmp_path / "plots" / "report.png", tmp_path / "plots" / "report.txt"]
    assert printed[0].read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["report.png", "report.txt"]


@pytest.mark.parametrize(
    ("output", "fragments"),
    [
        ("a_directory", ["`--output`", "is a directory", "report.png"]),
        ("report.txt", ["`--output`", "'.txt'", ".png"]),
        ("blocker.txt/report.png", ["`--output`", "not a directory"]),
    ],
)
def test_output_that_cannot_be_written(logged_run, tmp_path, capsys, output, fragments):
    _, csv_file = logged_run
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "blocker.txt").write_text("")
    outcome = run_cli(capsys, "report", str(csv_file), "-o", str(tmp_path / output))
    assert_one_error_line(outcome, repr(str(tmp_path / output)), *fragments)
    assert outcome.out == ""


# ---- a `.wandb` file cut short ------------------------------------------------------------------------------------


def _record_starts(data: bytes) -> list[int]:
    # The byte offset of each record of a small (one-block) `.wandb` file: 7-byte file header, then records with a
    # 7-byte header (crc32, length, type).
    assert len(data) < 32 * 1024
    starts, offset = [], 7
    while offset < len(data):
        starts.append(offset)
        offset += 7 + struct.unpack_from("<IHB", data, offset)[1]
    assert offset == len(data)
    return starts


@pytest.fixture
def cut(logged_run, tmp_path, monkeypatch):
    """``cut(n)``: a copy of the logged run's `.wandb` file, keeping its first ``n`` bytes."""
    import lightning_accum.cli.report as report_cli

    monkeypatch.setattr(report_cli, "UNFINISHED_RUN_WAIT_S", 0.0)  # nothing is writing these copies
    run_dir = logged_run[0] / "wandb"
    data = find_run_file(run_dir).read_bytes()

    def make(n: int) -> Path:
        path = tmp_path / "offline-run-20250101_000000-cut" / "run-cut.wandb"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data[:n])
        return path

    make.data, make.run_dir = data, run_dir
    return make


def test_the_complete_file_reads_as_complete(logged_run):
    run = read_offline_run(logged_run[0] / "wandb")
    assert run.exit_code == 0 and run.truncated_at is None and run.complete


def test_a_file_cut_inside_a_record_is_reported_as_truncated(cut, tmp_path, capsys):
    cut_record = _record_starts(cut.data)[-2]  # the one before the exit record: every history row is whole
    run_file = cut(cut_record + 10)
    run = read_offline_run(run_file)
    assert (run.truncated_at, run.exit_code, run.complete) == (cut_record, None, False)
    assert len(run.history) == len(read_offline_run(find_run_file(cut.run_dir)).history)

    outcome = run_cli(capsys, "report", str(run_file.parent), "-o", str(tmp_path / "r.png"))
    assert_one_error_line(outcome, str(run_file), "truncated", f"byte {cut_record} of", "--allow-incomplete")
    assert not (tmp_path / "r.png").exists()

    # What it holds can still be drawn, on request.
    outcome = run_cli(capsys, "report", str(run_file), "-o", str(tmp_path / "r.png"), "--allow-incomplete")
    assert outcome.code == 0 and f"wrote {tmp_path / 'r.png'}" in outcome.out.splitlines()
    assert "truncated" in outcome.err and outcome.err.startswith("warning: ")
    assert (tmp_path / "r.png").read_bytes().startswith(PNG_MAGIC)


def test_a_file_without_its_exit_record_says_the_run_did_not_finish(cut, tmp_path, capsys):
    run_file = cut(_record_starts(cut.data)[-1])  # every record but the last, the exit record
    run = read_offline_run(run_file)
    assert run.truncated_at is None and run.exit_code is None and len(run.history) > 0
    outcome = run_cli(capsys, "report", str(run_file), "-o", str(tmp_path / "r.png"))
    assert_one_error_line(outcome, str(run_file), "incomplete", "did not finish", "--allow-incomplete")


@pytest.mark.parametrize("n", [0, 3])
def test_a_file_cut_inside_its_header_is_reported_as_truncated(cut, tmp_path, capsys, n):
    outcome = run_cli(capsys, "report", str(cut(n)), "-o", str(tmp_path / "r.png"))
    assert_one_error_line(outcome, "run-cut.wandb", "truncated", f"{n} bytes")


def test_a_record_split_across_blocks_and_cut_is_truncated(tmp_path, capsys, monkeypatch):
    # A record too long for the rest of its block is written as fragments; a file that ends after the FIRST one was
    # cut inside the record.
    def record(kind: int, payload: bytes) -> bytes:
        return struct.pack("<IHB", zlib.crc32(bytes([kind]) + payload), len(payload), kind) + payload

    import lightning_accum.cli.report as report_cli

    monkeypatch.setattr(report_cli, "UNFINISHED_RUN_WAIT_S", 0.0)
    run_file = tmp_path / "run-frag.wandb"
    run_file.write_bytes(b":W&B" + struct.pack("<HB", 0xBEE1, 0) + record(2, b"\x00" * 100))
    run = read_offline_run(run_file)
    assert run.truncated_at == 7 and not run.complete
    outcome = run_cli(capsys, "report", str(run_file), "-o", str(tmp_path / "r.png"))
    assert_one_error_line(outcome, "truncated", "byte 7")


# ---- the picture: one x-range, whole-number ticks, events, the user's loss, the budget; the summary ----------------
INTEGER_PANELS = ["Effective batch size", "Micro-batch size", "Accumulation steps", "Items per step", "OOM retries"]
OOM_STEP = 7


class LogsItsLoss(RegressionModel):
    """Logs its own training loss, as a user's model does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss


def _csv_run(tmp_path: Path, owner, batch_size: int) -> Series:
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [owner, AccumulationMonitor()], logger=csv_logger, log_every_n_steps=1)
    trainer.fit(LogsItsLoss(), DataLoader(IndexedDataset(320), batch_size=batch_size))
    return load_series(csv_logger.log_dir)


@pytest.fixture(scope="module")
def split_run(tmp_path_factory) -> Series:
    """Split mode, 10 steps of 32: micro-batches of 16 grow to 32, then an OOM at step 7 halves them again."""
    injector = OOMInjector(OOMFault(step=OOM_STEP, micro_batch=0, phase="backward"))
    owner = AutoMicroBatching(16, max_memory=0.5, grow_patience=4, oom_cooldown=50, fault_injector=injector)
    return _csv_run(tmp_path_factory.mktemp("split"), owner, batch_size=32)


@pytest.fixture(scope="module")
def window_run(tmp_path_factory) -> Series:
    """Window mode (no memory budget), k = 1, 2, 4 from steps 0, 4, 8."""
    # 320 samples in micro-batches of 8: 4 + 4 x 2 + 7 x 4 = 40 micro-batches, 15 optimizer steps.
    return _csv_run(tmp_path_factory.mktemp("window"), AccumulationScheduler({0: 1, 4: 2, 8: 4}, unit="step"), 8)


def _axes(figure) -> dict[str, object]:
    return {ax.get_title(): ax for ax in figure.get_axes() if ax.get_visible() and ax.get_title()}


def _section_names(figure) -> list[str]:
    # A section's title is its name, then any scalar panel ("Memory   ·   capacity 23.5 GiB").
    return [subfigure.get_suptitle().split("   ·   ")[0] for subfigure in figure.subfigs]


def _marks(ax) -> dict[str, set[float]]:
    """The event marks on a panel: colour -> the steps of its vertical lines."""
    from matplotlib.colors import to_hex

    marks: dict[str, set[float]] = {}
    for line in ax.get_lines():
        if len(line.get_xdata()) == 2 and len(set(line.get_xdata())) == 1:  # axvline: one x, two points
            marks.setdefault(to_hex(line.get_color()), set()).add(float(line.get_xdata()[0]))
    return marks


def _mark_steps(ax, event_key: str) -> set[float]:
    from matplotlib.colors import to_hex

    from lightning_accum.cli.report import _EVENT_STYLE

    return _marks(ax).get(to_hex(_EVENT_STYLE[event_key][0]), set())


MARKED_PANELS = [
    "Effective batch size",
    "Micro-batch size",
    "Accumulation steps",
    "Peak memory",
    "Peak fraction vs budget",
]


def test_every_panel_shares_one_x_range_and_counts_get_whole_number_ticks(split_run):
    axes = _axes(build_figure(split_run))
    assert set(axes) == {
        *["Effective batch size", "Micro-batch size", "Accumulation steps", "Items per step", "Window loss"],
        *["Peak memory", "Peak fraction vs budget", "OOM retries", "Events", "Samples / s", "Items / s"],
        *["Training time", "Samples seen", "Items seen"],  # an owner counts what it consumed, split mode too
    }
    assert {ax.get_xlim() for ax in axes.values()} == {axes["Micro-batch size"].get_xlim()}
    low, high = axes["Events"].get_xlim()
    assert low < 0 and high > 9  # the whole run, steps 0 to 9, not just the steps with an event
    for title in [*INTEGER_PANELS, "Events"]:
        ticks = axes[title].get_yticks()
        assert all(float(t).is_integer() for t in ticks), (title, ticks)
    for ax in axes.values():
        assert all(float(t).is_integer() for t in ax.get_xticks())  # no "step 2.5"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Series:
    """Three optimizer steps: a range of 3 steps, where matplotlib's own ticks would be 0, 0.5, 1, ..."""
    tmp_path = tmp_path_factory.mktemp("short")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], logger=csv_logger)
    trainer.fit(LogsItsLoss(), DataLoader(IndexedDataset(24), batch_size=4))
    return load_series(csv_logger.log_dir)


def test_a_short_run_gets_whole_number_step_ticks(short_run):
    assert [s for s, _ in short_run[keys.EFFECTIVE_BATCH_SIZE]] == [0, 1, 2]
    for title, ax in _axes(build_figure(short_run)).items():
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == [0, 1, 2], (title, ticks)


def test_panels_of_keys_never_logged_are_left_out(split_run):
    # No `gradient_noise_scale=True`, and a CPU has no caching allocator: nothing to draw in those panels.
    assert not any(split_run.get(key) for key in (*keys.NOISE_SCALE_KEYS, keys.ALLOC_RETRIES))
    figure = build_figure(split_run)
    assert _section_names(figure) == ["Batch", "Memory", "Recovery", "Throughput"]
    assert not {"Noise scale vs items per step", "|G|² and tr(Σ)", "Allocator retries"} & set(_axes(figure))
    assert not [ax for ax in _axes(figure).values() if "nothing logged" in [t.get_text() for t in ax.texts]]


def test_panels_of_logged_keys_are_drawn(split_run):
    steps = [s for s, _ in split_run[keys.ITEMS_PER_STEP]]
    logged = {
        **split_run,
        keys.GRADIENT_NOISE_SCALE: [(s, 20.0 + s) for s in steps],
        keys.GRAD_SQ_NORM: [(s, 1.0) for s in steps],
        keys.GRAD_TRACE_COV: [(s, 20.0 + s) for s in steps],
        keys.ALLOC_RETRIES: [(s, float(s > 5)) for s in steps],
    }
    figure = build_figure(logged)
    assert _section_names(figure) == ["Batch", "Noise scale", "Memory", "Recovery", "Throughput"]
    axes = _axes(figure)
    assert {"Noise scale vs items per step", "|G|² and tr(Σ)", "Allocator retries"} <= set(axes)
    drawn = {line.get_label() for line in axes["Noise scale vs items per step"].get_lines()}
    assert {keys.GRADIENT_NOISE_SCALE, keys.ITEMS_PER_STEP} <= drawn


def test_events_are_marked_on_the_batch_and_memory_panels(split_run):
    # Each mark sits at the first step logged at the new micro-batch size: where the line moves.
    sizes = dict(split_run[keys.MICRO_BATCH_SIZE])
    grown = [s for s, _ in split_run[keys.EVENT_GROW]]
    assert grown and all(sizes[s] > sizes[s - 1] for s in grown)
    assert sizes[OOM_STEP] < sizes[OOM_STEP - 1]
    axes = _axes(build_figure(split_run))
    for title in MARKED_PANELS:
        assert _mark_steps(axes[title], keys.EVENT_OOM_RECOVERED) == {OOM_STEP}, title
        assert _mark_steps(axes[title], keys.EVENT_GROW) == set(grown), title
        assert not _mark_steps(axes[title], keys.EVENT_SHRINK), title
    for title in ["Window loss", "Items per step", "OOM retries", "Samples / s"]:
        assert not _marks(axes[title]), title


def test_shrink_and_schedule_marks(split_run):
    # A shrink (peak over the budget) at step 3 and a schedule change at step 5, each in its own colour.
    logged = {**split_run, keys.EVENT_SHRINK: [(3.0, 8.0)], keys.EVENT_SCHEDULE_CHANGE: [(5.0, 2.0)]}
    axes = _axes(build_figure(logged))
    for title in MARKED_PANELS:
        assert _mark_steps(axes[title], keys.EVENT_SHRINK) == {3.0}, title
        assert _mark_steps(axes[title], keys.EVENT_SCHEDULE_CHANGE) == {5.0}, title
    assert len(_marks(axes["Micro-batch size"])) == 4  # OOM, grow, shrink and schedule: four colours


def test_legends_only_where_lines_need_telling_apart(split_run):
    axes = _axes(build_figure(split_run))
    assert axes["Peak memory"].get_legend() is not None  # the peak and the budget, in GiB (no reserved peak on a CPU)
    assert axes["Samples / s"].get_legend() is None
    assert axes["Peak fraction vs budget"].get_legend() is not None  # the peak and the budget
    assert axes["Window loss"].get_legend() is not None  # ours and the user's
    assert axes["Events"].get_legend() is not None


def test_a_flat_zero_line_stays_above_the_frame_and_huge_values_get_short_labels(window_run):
    # Window mode: no OOMs, so 0 throughout. A loss that diverged to 1e18: "1e18" above the axis, not 19 digits.
    diverged = {**window_run, keys.WINDOW_LOSS: [(s, v * 1e18) for s, v in window_run[keys.WINDOW_LOSS]]}
    figure = build_figure(diverged)
    figure.canvas.draw()
    axes = _axes(figure)
    assert {v for _, v in window_run[keys.OOM_RETRIES]} == {0}
    assert axes["OOM retries"].get_ylim()[0] < 0
    labels = [label.get_text() for label in axes["Window loss"].get_yticklabels()]
    assert max(len(text) for text in labels) <= 5, labels
    assert "1e18" in axes["Window loss"].yaxis.get_offset_text().get_text()


def test_the_users_loss_is_drawn_next_to_the_window_loss(window_run):
    assert user_loss_keys(window_run) == ["train/loss"]
    lines = {line.get_label(): line for line in _axes(build_figure(window_run))["Window loss"].get_lines()}
    assert list(lines["train/loss (yours)"].get_xdata()) == [s for s, _ in window_run["train/loss"]]
    assert keys.WINDOW_LOSS in lines


def test_without_a_budget_the_peak_fills_its_panel(window_run):
    assert {v for _, v in window_run[BUDGET_FRACTION]} == {1.0}  # window mode: no budget
    ax = _axes(build_figure(window_run))["Peak fraction vs budget"]
    peak = max(v for _, v in window_run[keys.PEAK_FRACTION])
    assert ax.get_ylim()[1] == pytest.approx(1.1 * peak)
    drawn = [line for line in ax.get_lines() if len(set(line.get_xdata())) > 1]  # not the event marks
    assert [line.get_label() for line in drawn] == [keys.PEAK_FRACTION]
    assert "no memory budget (window mode)" in ax.get_legend_handles_labels()[1]


def test_the_summary_of_a_split_run_with_an_oom(split_run, tmp_path):
    text = summarize(split_run)
    assert text.startswith("10 optimizer steps (steps 0 to 9).")
    assert "Effective batch 32 samples per step throughout" in text
    assert "micro-batch 16 to 32 samples, settled at 16 from step 7" in text
    assert f"1 OOM recovered (at step {OOM_STEP})." in text
    capacity = split_run[keys.CAPACITY_GIB][-1][1]
    assert f"against a budget of {size_text(0.5 * capacity)} (50.0% of the capacity), within it." in text
    assert "samples/s (median of the logged intervals" in text and "the whole fit's average" in text
    output = write_report(split_run, tmp_path / "r.png")
    assert output.with_suffix(".txt").read_text() == text + "\n"


def test_the_budget_reads_in_a_size_on_the_panel_of_the_peak(split_run):
    # A CPU run under max_memory="500MiB": 2.1% of 23.5 GiB. As a fraction, the peak and the budget both read 0.02.
    capacity = 23.54
    budget = 500 / 1024
    peaks = [(float(s), budget * (1.05 if s == 4 else 0.9)) for s in range(10)]
    run = {
        **split_run,
        keys.CAPACITY_GIB: [(s, capacity) for s, _ in peaks],
        BUDGET_FRACTION: [(s, budget / capacity) for s, _ in peaks],
        keys.PEAK_GIB: peaks,
        keys.PEAK_FRACTION: [(s, v / capacity) for s, v in peaks],
    }
    text = summarize(run)
    assert (
        "Peak memory 525 MiB (2.2% of 23.5 GiB) against a budget of 500 MiB (2.1% of the capacity), over it at 1"
        in text
    )
    lines = {line.get_label(): line for line in _axes(build_figure(run))["Peak memory"].get_lines()}
    assert list(lines["budget 500 MiB"].get_ydata()) == pytest.approx([budget] * 10)
    assert size_text(0.4883) == "500 MiB" and size_text(23.54) == "23.5 GiB"


def test_the_summary_of_a_window_run(window_run):
    text = summarize(window_run)
    assert "Effective batch 8 samples per step, 16 from step 4, 32 from step 8" in text
    assert "micro-batch 8 samples throughout; k = 4 at the end." in text
    assert "No OOMs." in text and "with no memory budget set." in text


# ---- split by tokens: the token budget and the padding (issue 21, item 4) -----------------------------------------
@pytest.fixture(scope="module")
def token_run(tmp_path_factory) -> tuple[Series, list[dict], Path]:
    """A real fit split by tokens into a CSV: 3 steps of 16 log-normal sequences at a pinned budget of 96 tokens; the
    series, each step's figures worked out from what the model computed, and the CSV."""
    from tests.callbacks.test_monitor import token_fit, token_steps

    tmp_path = tmp_path_factory.mktemp("tokens")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    _, model, lengths = token_fit(tmp_path, csv_logger, [AccumulationMonitor()])
    expected = token_steps(model.micro_batch_shapes, model.step_indices, lengths)
    return load_series(csv_logger.log_dir), expected, Path(csv_logger.log_dir) / "metrics.csv"


def _line(ax, key: str):
    (line,) = [line for line in ax.get_lines() if line.get_label() == key]
    return line


def test_a_run_split_by_tokens_draws_the_token_budget_and_the_padding(token_run, tmp_path, capsys):
    series, expected, csv_file = token_run
    figure = build_figure(series)
    assert _section_names(figure) == ["Batch", "Tokens", "Memory", "Recovery", "Throughput"]
    axes = _axes(figure)
    budget, padding = (
        _line(axes["Token budget"], keys.MICRO_BATCH_TOKENS),
        _line(axes["Padding"], keys.PADDING_FRACTION),
    )
    assert list(budget.get_xdata()) == list(padding.get_xdata()) == [0, 1, 2]
    assert list(budget.get_ydata()) == [96, 96, 96]
    assert list(padding.get_ydata()) == pytest.approx([step["padding"] for step in expected], rel=1e-9)
    assert all(float(t).is_integer() for t in axes["Token budget"].get_yticks())
    low, high = axes["Padding"].get_ylim()
    assert low < 0 < max(padding.get_ydata()) < high  # from zero, so that the share reads as a share
    # The number of micro-batches is the accumulation steps' panel: each step's own.
    steps = _line(axes["Accumulation steps"], keys.ACCUMULATION_STEPS)
    assert list(steps.get_ydata()) == [step["micro_batches"] for step in expected]
    assert {ax.get_xlim() for ax in axes.values()} == {axes["Token budget"].get_xlim()}

    outcome = run_cli(capsys, "report", str(csv_file), "-o", str(tmp_path / "tokens.png"))
    assert outcome.code == 0 and "Token budget 96 padded tokens per micro-batch throughout" in outcome.out
    assert (tmp_path / "tokens.png").read_bytes().startswith(PNG_MAGIC)


def test_the_summary_of_a_run_split_by_tokens(token_run):
    series, expected, _ = token_run
    text = summarize(series)
    paddings = sorted(step["padding"] for step in expected)
    largest = [step["largest"] for step in expected]
    assert (
        f"the largest micro-batch {min(largest)} to {max(largest)} samples; k = {expected[-1]['micro_batches']}" in text
    )
    assert (
        f"Token budget 96 padded tokens per micro-batch throughout; padding {paddings[1]:.1%} of the token positions"
        " computed (median of the logged steps)." in text
    )
    assert "settled" not in text


def test_by_tokens_the_summary_infers_no_world_size_from_the_micro_batch():
    # By samples, 16 samples a step in 2 micro-batches of 4 mean 2 ranks; by tokens, 4 is only the largest micro-batch.
    series: Series = {
        keys.EFFECTIVE_BATCH_SIZE: [(0.0, 16.0)],
        keys.MICRO_BATCH_SIZE: [(0.0, 4.0)],
        keys.ACCUMULATION_STEPS: [(0.0, 2.0)],
    }
    assert "k = 2 at the end on 2 ranks." in summarize(series)
    tokens = {**series, keys.MICRO_BATCH_TOKENS: [(0.0, 64.0)], keys.PADDING_FRACTION: [(0.0, 0.125)]}
    text = summarize(tokens)
    assert "k = 2 at the end." in text and "ranks" not in text
    assert "Token budget 64 padded tokens per micro-batch throughout; padding 12.5% of" in text


# ---- issue 25, item 7: a run split by tokens says its events move the token budget ---------------------------------


def test_a_token_runs_events_are_labelled_as_the_token_budgets(split_run):
    from lightning_accum.cli.report import build_figure

    # The same run's series, as a run split by tokens logs it: its shrinks move the token budget (450 -> 290 tokens).
    tokens = {
        **split_run,
        keys.MICRO_BATCH_TOKENS: [(0.0, 450.0), (1.0, 420.0), (2.0, 370.0), (3.0, 290.0)],
        keys.EVENT_SHRINK: [(1.0, 420.0), (2.0, 370.0), (3.0, 290.0)],
    }
    by_samples, by_tokens = _axes(build_figure(split_run)), _axes(build_figure(tokens))
    assert by_samples["Events"].get_ylabel() == "samples / micro-batch after the change"
    assert by_tokens["Events"].get_ylabel() == "token budget after the change (tokens)"
    labels = by_tokens["Events"].get_legend_handles_labels()[1]
    assert f"{keys.EVENT_SHRINK}: token budget shrunk" in labels
    assert not any("micro-batch shrunk" in label for label in labels)
    figure = build_figure(tokens)
    legend_texts = [t.get_text() for sub in figure.subfigs for legend in sub.legends for t in legend.get_texts()]
    assert "token budget shrunk" in legend_texts and "micro-batch shrunk" not in legend_texts


def test_the_summary_of_a_run_split_on_several_ranks_gives_their_imbalance_and_the_wait():
    series: Series = {
        keys.EFFECTIVE_BATCH_SIZE: [(0.0, 16.0), (1.0, 16.0), (2.0, 16.0)],
        keys.RANK_IMBALANCE: [(0.0, 1.5), (1.0, 1.1), (2.0, 1.2)],
        keys.SYNC_WAIT_SECONDS: [(0.0, 0.25), (1.0, 0.02), (2.0, 0.04)],
    }
    text = summarize(series)
    assert "Slowest rank's step 1.20x the mean rank's (median of the logged steps, worst 1.50x);" in text
    assert "the longest wait at the sync 40 ms a step (median)." in text
    assert "Slowest rank" not in summarize({keys.EFFECTIVE_BATCH_SIZE: [(0.0, 16.0)]})
