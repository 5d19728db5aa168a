"""The memory probe, its tracker and the ``lightning-accum probe`` command, on two models at opposite ends.

``ParamHeavy`` (wide Linear layers, tiny batch, SGD): parameters and gradients dominate the peak.
``ActHeavy`` (deep narrow network, large batch): activations dominate the peak.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from lightning_accum.cli.main import main
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.probe import import_object, load_cli_config, probe_memory

_MiB = 2**20


class _Stack(pl.LightningModule):
    def __init__(self, width: int, depth: int, optimizer: str = "sgd") -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(width, width)]
        for _ in range(depth - 1):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers)
        self.optimizer = optimizer

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.log("train_loss", 0.0)  # must not need a Trainer
        return nn.functional.mse_loss(self.net(x)[:, :1], y)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return {"optimizer": torch.optim.Adam(self.parameters(), lr=1e-3)}
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ParamHeavy(_Stack):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(width=1024, depth=3, optimizer=optimizer)


class ActHeavy(_Stack):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(width=64, depth=24, optimizer=optimizer)


def regression_batch(micro_batch_size: int, dim: int = 64) -> tuple[Tensor, Tensor]:
    return torch.randn(micro_batch_size, dim), torch.randn(micro_batch_size, 1)


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def act_heavy():
    return probe_memory(
        ActHeavy, lambda b: regression_batch(b, 64), batch_size=512, accumulation_steps=(2, 4), budget_bytes=2 * _MiB
    )


@pytest.fixture(scope="module")
def param_heavy():
    return probe_memory(
        ParamHeavy,
        lambda b: regression_batch(b, 1024),
        batch_size=8,
        accumulation_steps=(4,),
        fit_micro_batch_sizes=(1, 2, 4),
    )


# ---- the tracker ----------------------------------------------------------------------------------------------------


def test_tracker_counts_exact_bytes_by_category():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = 4 * (128 * 256 + 256 + 256 * 128 + 128)
    with MemoryTracker(model, [opt]) as tracker:
        assert tracker.current.by_category == {
            "parameters": weights,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 0,
        }
        x = torch.ones(32, 128)  # created inside: an input, counted as activation
        loss = model(x).sum()
        # the input and the ReLU output are saved for backward; the last Linear's output only lives until the sum
        assert tracker.current.by_category["activations"] == 4 * 32 * (128 + 256) + 4
        loss.backward()
        del loss, x
        assert tracker.current.by_category["gradients"] == weights
        assert tracker.current.by_category["activations"] == 0  # everything of the pass has been freed
        opt.step()
        assert tracker.current.by_category["optimizer_state"] == weights  # one momentum buffer per parameter
        opt.zero_grad(set_to_none=True)
        assert tracker.current.total_bytes == 2 * weights
    assert tracker.peak.total_bytes >= 2 * weights + 4 * 32 * 256


def test_tracker_reset_peak_and_phases():
    model = nn.Linear(64, 64)
    with MemoryTracker(model) as tracker:
        with tracker.phase("big"):
            big = torch.zeros(1024, 1024)
        del big
        assert tracker.peak.phase == "big"
        tracker.reset_peak()
        assert tracker.peak.total_bytes == tracker.current.total_bytes == 4 * (64 * 64 + 64)
    with pytest.raises(ValueError, match=r"`category` must be one of"):
        tracker.track(torch.ones(1), "weights")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present here")
def test_tracker_agrees_with_cuda_allocator():
    model = _Stack(width=256, depth=8).cuda()
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        model.net(torch.randn(256, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state and cuBLAS workspaces exist from here on, outside what we compare
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with MemoryTracker(model, [opt], device="cuda") as tracker:
        start = tracker.current.total_bytes
        step()
    torch.cuda.synchronize()
    allocator_rise = torch.cuda.max_memory_allocated() - base
    tracker_rise = tracker.peak.total_bytes - start
    assert tracker.peak.by_category["parameters"] == _grad_bytes(model)
    # The allocator rounds every block up to 512 bytes and sees scratch memory inside kernels; the tracker does not.
    assert tracker_rise == pytest.approx(allocator_rise, rel=0.1, abs=256 * 1024)


# ---- the two comparisons --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4])
def test_activation_heavy_full_batch_costs_more_than_accumulation(act_heavy, k):
    b = 512 // k
    full, acc = act_heavy.measurement(512, 1), act_heavy.measurement(b, k)
    assert full.peak_bytes > acc.peak_bytes
    # The saving is the activations of B - b samples less the gradient buffer accumulation keeps alive.
    expected = act_heavy.peak_model.per_sample_bytes * (512 - b) - act_heavy.gradient_bytes
    assert full.peak_bytes - acc.peak_bytes == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_costs_one_gradient_copy_over_the_same_micro_batch(act_heavy, k):
    b = 512 // k
    grad = _grad_bytes(ActHeavy())
    assert act_heavy.gradient_bytes == grad
    extra = act_heavy.measurement(b, k).peak_bytes - act_heavy.measurement(b, 1).peak_bytes
    assert extra == pytest.approx(grad, rel=0.1)
    assert act_heavy.measurement(b, k).breakdown["gradients"] == grad
    assert act_heavy.measurement(b, 1).breakdown["gradients"] == 0  # k=1 peaks before any gradient exists


def test_parameter_heavy_orders_configurations(param_heavy):
    grad = _grad_bytes(ParamHeavy())
    full, acc, same = (param_heavy.measurement(*c) for c in ((8, 1), (2, 4), (2, 1)))
    # Accumulation costs more than the same micro-batch without it, by at most one gradient copy.
    assert 0 < acc.peak_bytes - same.peak_bytes <= grad
    # With activations this small the saving against the full batch cannot pay for the gradient buffer:
    # accumulation peaks higher than the full batch, again by at most one gradient copy.
    assert 0 < acc.peak_bytes - full.peak_bytes <= grad
    assert full.breakdown["parameters"] == acc.breakdown["parameters"] == grad


def test_adam_step_sets_the_peak_when_parameters_dominate():
    result = probe_memory(
        ParamHeavy,
        lambda b: regression_batch(b, 1024),
        batch_size=4,
        accumulation_steps=(2,),
        fit_micro_batch_sizes=(),
        module_init_args={"optimizer": "adam"},
    )
    peaks = {m.label: m.peak_bytes for m in result.measurements}
    assert len(set(peaks.values())) == 1, peaks
    assert all(m.peak_phase == "optimizer" for m in result.measurements)
    # exp_avg and exp_avg_sq per parameter, plus Adam's float32 `step` counter for each of the 6 parameters
    assert result.measurement(4, 1).breakdown["optimizer_state"] == 2 * result.gradient_bytes + 4 * 6


def test_micro_batch_not_k_sets_activation_memory(act_heavy):
    by_k = {k: act_heavy.measurement(128, k) for k in (1, 2, 4)}
    assert by_k[2].peak_bytes == by_k[4].peak_bytes
    assert by_k[1].breakdown["activations"] == by_k[2].breakdown["activations"] == by_k[4].breakdown["activations"]
    assert act_heavy.measurement(256, 2).breakdown["activations"] > 1.9 * by_k[2].breakdown["activations"]


# ---- the fit and the report -----------------------------------------------------------------------------------------


def test_fit_predicts_held_out_micro_batch_sizes_within_15_percent(act_heavy):
    assert act_heavy.holdout_sizes and act_heavy.fit_sizes
    assert act_heavy.holdout_error is not None
    print(f"held-out relative error: {act_heavy.holdout_error:.4%} on b={act_heavy.holdout_sizes}")
    assert act_heavy.holdout_error < 0.15
    b = act_heavy.fitting_micro_batch_size
    assert b is not None and 1 <= b <= 512
    assert act_heavy.peak_model.predict(b) <= 2 * _MiB
    assert b == 512 or act_heavy.peak_model.predict(b + 1) > 2 * _MiB


def test_table_dict_and_plot(act_heavy, tmp_path):
    table = act_heavy.table()
    assert "b=" not in table.splitlines()[1]  # header row
    assert "the micro-batch size, not k, sets activation memory" in table.lower()
    data = json.loads(json.dumps(act_heavy.to_dict()))
    assert {(m["micro_batch_size"], m["accumulation_steps"]) for m in data["measurements"]} >= {
        (512, 1),
        (256, 2),
        (256, 1),
        (128, 4),
        (128, 1),
    }
    assert data["fit"]["holdout_relative_error"] == act_heavy.holdout_error
    assert [c["k"] for c in data["comparisons"]] == [2, 4]
    png = act_heavy.plot(tmp_path / "probe.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- inputs ---------------------------------------------------------------------------------------------------------


class _Dataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return torch.randn(64), torch.randn(1)


class RegressionData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Dataset(), batch_size=self.batch_size)


def test_datamodule_and_instance_give_the_same_peaks_as_a_factory():
    from_dm = probe_memory(
        ActHeavy(), RegressionData(), batch_size=32, accumulation_steps=(2,), fit_micro_batch_sizes=()
    )
    from_paths = probe_memory(
        "tests.test_probe:ActHeavy",
        "tests.test_probe:regression_batch",
        batch_size=32,
        accumulation_steps=(2,),
        fit_micro_batch_sizes=(),
        data_init_args={"dim": 64},
    )
    assert [m.peak_bytes for m in from_dm.measurements] == [m.peak_bytes for m in from_paths.measurements]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 10, "accumulation_steps": (4,)}, ValueError, r"holds 4, which does not divide `batch_size`=10"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an int >= 1, got 0"),
        ({"batch_size": 8, "accumulation_steps": (1,)}, ValueError, r"`accumulation_steps` must be an int >= 2, got 1"),
        ({"batch_size": 8, "steps": 0}, ValueError, r"`steps` must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        probe_memory(ActHeavy, regression_batch, **kwargs)


def test_bad_import_paths_are_named():
    with pytest.raises(ValueError, match=r"`module` must be an import path like 'pkg.module:Name', got 'ActHeavy'"):
        probe_memory("ActHeavy", regression_batch, batch_size=4)
    with pytest.raises(ImportError, match=r"module 'tests.test_probe' has no attribute 'Nope'"):
        import_object("tests.test_probe:Nope", "module")


def test_manual_optimization_is_refused():
    class Manual(ActHeavy):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(RuntimeError, match="uses manual optimization"):
        probe_memory(Manual, regression_batch, batch_size=4, accumulation_steps=(2,), fit_micro_batch_sizes=())


# ---- the command line -----------------------------------------------------------------------------------------------


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "probe",
            "--model",
            "tests.test_probe:ActHeavy",
            "--data",
            "tests.test_probe:RegressionData",
            "--data-init-args",
            '{"batch_size": 32}',
            "--accumulation-steps",
            "2",
            "--accumulation-steps",
            "4",
            "--budget-gib",
            "0.001",
            "--steps",
            "1",
            "--output-dir",
            str(out),
        ]
    )
    assert code == 0
    assert "B=32" in capsys.readouterr().out  # the datamodule's batch size is the default B
    data = json.loads((out / "probe.json").read_text())
    assert data["batch_size"] == 32 and data["accumulation_steps"] == [2, 4]
    assert data["fitting_micro_batch_size"] is not None
    assert "Full batch vs accumulation" in (out / "probe.txt").read_text()
    assert (out / "probe.png").stat().st_size > 10_000


def test_cli_reads_a_lightning_cli_config(tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text(
        "trainer:\n  max_epochs: 1\n"
        "model:\n  class_path: tests.test_probe.ActHeavy\n  init_args:\n    optimizer: adam\n"
        "data:\n  batch_size: 4\n"  # only init args: the class comes from --data
    )
    make_model, make_data = load_cli_config(config, data_class="tests.test_probe:RegressionData")
    assert make_model().optimizer == "adam" and make_data().batch_size == 4
    code = main(
        [
            "probe",
            "--config",
            str(config),
            "--data",
            "tests.test_probe:RegressionData",
            "--batch-size",
            "2",
            "--accumulation-steps",
            "2",
            "--fit-micro-batch-sizes",
            "1",
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert json.loads((tmp_path / "probe.json").read_text())["batch_size"] == 2


def test_cli_config_without_class_path_says_how_to_fix(tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("model:\n  width: 3\n")
    with pytest.raises(ValueError, match=r"the `model` section has no `class_path`.*`--model pkg.mod:Class`"):
        load_cli_config(config)
