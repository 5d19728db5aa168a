"""Split mode: the step batch is cut into micro-batches that fit, and every update equals the full-batch update."""

from __future__ import annotations

import copy
import csv
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, AutoMicroBatching
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.split.planner.messages import MicroBatchOOMError
from tests.helpers import (
    FP32,
    TokenDataset,
    TokenModel,
    assert_grads_close,
    count_tokens,
    make_trainer,
    replay_reference,
    token_loss,
)


class SplitTokenModel(TokenModel):
    """Records the micro-batch sizes ``training_step`` sees and what it logs."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.split_mode = True
        self.micro_batch_sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.micro_batch_sizes.append(len(batch["x"]))
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def fit_split(tmp_path, callback, n=48, step_batch=16, lr=0.05, **trainer_kwargs):
    dataset = TokenDataset(n)
    model = SplitTokenModel(lr=lr)
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path, [callback], **trainer_kwargs)
    trainer.fit(model, DataLoader(dataset, batch_size=step_batch))
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=lr)
    return model, expected, trainer


@pytest.mark.parametrize("micro_batch_size", [4, 5, 16])
def test_split_steps_are_exact(tmp_path, micro_batch_size):
    callback = AutoMicroBatching(micro_batch_size, count_items=count_tokens)
    model, expected, trainer = fit_split(tmp_path, callback)
    assert trainer.global_step == 3  # one optimizer step per dataloader batch
    assert max(model.micro_batch_sizes) <= micro_batch_size
    assert sum(model.micro_batch_sizes) == 48  # no sample seen twice
    assert_grads_close(model.step_grads, expected, **FP32)
    assert callback.last_step_report.effective_batch_size == 16


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("micro_batch", [0, 1, 3])
def test_oom_in_any_micro_batch_retries_the_same_step_exactly(tmp_path, phase, micro_batch):
    injector = OOMInjector(OOMFault(step=1, micro_batch=micro_batch, phase=phase))
    callback = AutoMicroBatching(4, count_items=count_tokens, fault_injector=injector)
    model, expected, trainer = fit_split(tmp_path, callback)
    assert injector.fired == [(0, 1, micro_batch, phase)]
    assert callback.oom_retries == 1
    assert trainer.global_step == 3
    assert_grads_close(model.step_grads, expected, **FP32)
    events = [(e.kind, e.before, e.after) for e in callback.events]
    assert events[0] == ("oom_recovered", 4, 2)


def test_oom_at_the_minimum_size_raises_with_the_memory_figures(tmp_path):
    injector = OOMInjector(OOMFault(step=0, micro_batch=None, phase="forward", times=None))
    callback = AutoMicroBatching(4, min_micro_batch_size=2, count_items=count_tokens, fault_injector=injector)
    with pytest.raises(MicroBatchOOMError, match="micro-batch size 2"):
        fit_split(tmp_path, callback)


def test_errors_that_are_not_oom_pass_through_untouched(tmp_path):
    class Broken(SplitTokenModel):
        def training_step(self, batch, batch_idx):
            raise KeyError("labels")

    callback = AutoMicroBatching(4)
    trainer = make_trainer(tmp_path, [callback])
    with pytest.raises(KeyError, match="labels"):
        trainer.fit(Broken(), DataLoader(TokenDataset(16), batch_size=8))
    assert callback.oom_retries == 0


@pytest.mark.parametrize("oom_phase", [None, "forward", "backward"])
def test_self_log_combines_micro_batches_into_one_item_weighted_value(tmp_path, oom_phase):
    # With an OOM in the first step, the failed attempt's logs are dropped and later steps still log.
    injector = OOMInjector(OOMFault(step=0, micro_batch=1, phase=oom_phase)) if oom_phase else None
    logger = CSVLogger(tmp_path, name="logs")
    callback = AutoMicroBatching(4, count_items=count_tokens, fault_injector=injector)
    model, expected_grads, _ = fit_split(tmp_path, callback, n=32, logger=logger, log_every_n_steps=1)
    assert callback.oom_retries == (1 if oom_phase else 0)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    step_values = [float(r["train_loss_step"]) for r in rows if r.get("train_loss_step")]
    # What the unsplit batch logs: the token mean over the whole step batch, at that step's parameters.
    dataset = TokenDataset(32)
    reference = SplitTokenModel(lr=0.05)
    expected = []
    for indices, grads in zip(model.step_indices, expected_grads, strict=False):
        batch = {k: torch.stack([dataset[i][k] for i in indices]) for k in dataset[0]}
        with torch.no_grad():
            expected.append(float(token_loss(reference, batch)))
            for name, p in reference.named_parameters():
                p -= 0.05 * grads[name]
    assert step_values == pytest.approx(expected, rel=1e-5)
    epoch_values = [float(r["train_loss_epoch"]) for r in rows if r.get("train_loss_epoch")]
    assert epoch_values == pytest.approx([sum(expected) / 2], rel=1e-5)  # two steps of 16 samples each


def test_accumulate_grad_batches_on_the_trainer_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, [AutoMicroBatching()], accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` cannot be combined with `AutoMicroBatching`"):
        trainer.fit(SplitTokenModel(), DataLoader(TokenDataset(8), batch_size=4))


def test_two_accumulation_callbacks_are_refused(tmp_path):
    trainer = make_trainer(tmp_path, [AutoMicroBatching(), AccumulationScheduler()])
    with pytest.raises(RuntimeError, match="both want to own gradient accumulation"):
        trainer.fit(SplitTokenModel(), DataLoader(TokenDataset(8), batch_size=4))


def test_manual_optimization_is_refused(tmp_path):
    model = SplitTokenModel()
    model.automatic_optimization = False
    trainer = make_trainer(tmp_path, [AutoMicroBatching()])
    with pytest.raises(RuntimeError, match="needs automatic optimization"):
        trainer.fit(model, DataLoader(TokenDataset(8), batch_size=4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_memory": 1.5}, ValueError, r"must be in \(0, 1\], got 1.5"),
        ({"max_memory": 0.0}, ValueError, r"must be in \(0, 1\], got 0.0"),
        ({"max_memory": -5}, ValueError, r"in bytes must be >= 1, got -5"),
        ({"max_memory": "8 bananas"}, ValueError, r"such as .8GiB. or .500MB., got .8 bananas."),
        ({"micro_batch_size": 0}, ValueError, r"micro_batch_size"),
        (
            {"gradient_sync": "eager"},
            ValueError,
            r"`gradient_sync` must be 'deferred' \(.*\) or 'overlap' \(.*\), got 'eager'",
        ),
        ({"pin_micro_batch_size": True}, ValueError, r"needs an int `micro_batch_size` to pin.*Pass e\.g\."),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AutoMicroBatching(**kwargs)


class ActivationHeavyModel(SplitTokenModel):
    """Each sample materialises a large activation, and a 'ballast' phase holds extra memory for some steps."""

    def __init__(self, ballast_steps: range, ballast_bytes: int, width: int = 1 << 16) -> None:
        super().__init__(lr=0.01)
        self.ballast_steps, self.ballast_bytes, self.width = ballast_steps, ballast_bytes, width
        self._ballast: torch.Tensor | None = None
        self.step_sizes: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.global_step in self.ballast_steps and self._ballast is None:
            self._ballast = torch.ones(self.ballast_bytes // 4)  # touched, so it is resident
        elif self.global_step not in self.ballast_steps:
            self._ballast = None

    def training_step(self, batch, batch_idx):
        self.micro_batch_sizes.append(len(batch["x"]))
        x = batch["x"].sum(-1, keepdim=True) * torch.ones(1, self.width)  # (b, T, width): memory grows with b
        per_token = (self.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2 + 0 * x.mean(-1)
        return (per_token * batch["mask"]).sum() / batch["mask"].sum().clamp(min=1)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_sizes.append(max(self.micro_batch_sizes[-1:] or [0]))


def test_shrinks_under_a_byte_budget_and_grows_back_after_a_memory_hungry_phase(tmp_path):
    from lightning_accum.memory.backends import CPUBackend

    backend = CPUBackend()
    backend.reset_peak()
    baseline = backend.current_bytes()
    per_sample = 8 * (1 << 16) * 4  # T x width floats of the activation, twice (the product and its mean input)
    budget = baseline + 40 * per_sample
    model = ActivationHeavyModel(ballast_steps=range(6, 14), ballast_bytes=20 * per_sample)
    callback = AutoMicroBatching("auto", max_memory=budget, grow_patience=2, oom_cooldown=4, count_items=count_tokens)
    peaks: list[int] = []
    on_step = callback.planner.on_step

    def record_peak(size, peak_bytes, step, alloc_retries_delta=0):
        peaks.append(peak_bytes)
        return on_step(size, peak_bytes, step, alloc_retries_delta)

    callback.planner.on_step = record_peak
    reports = ReportRecorder(callback)
    trainer = make_trainer(tmp_path, [callback, reports], max_steps=24)
    trainer.fit(model, DataLoader(TokenDataset(64 * 24), batch_size=64))
    kinds = [e.kind for e in callback.events]
    sizes = model.step_sizes
    print("sizes", sizes, "events", [(e.step, e.kind, e.before, e.after) for e in callback.events])
    print("peaks over budget (MiB)", [round((p - budget) / 2**20) for p in peaks])
    assert "shrink" in kinds, (kinds, sizes)
    assert "grow" in kinds[kinds.index("shrink") :], (kinds, sizes)
    assert min(sizes[6:14]) < max(sizes[:6]), sizes
    assert sizes[-1] > min(sizes[6:14]), sizes
    # Settled, i.e. once the planner stopped shrinking: the peak stays under the budget, growth included.
    last_shrink = max(e.step for e in callback.events if e.kind == "shrink")
    # (A shrink decided after the last step leaves nothing to check.)
    assert max(peaks[last_shrink:], default=0) <= budget, [round((p - budget) / 2**20) for p in peaks]
    # Each resize is reported with the first step that runs at the new size, where the logged size changes.
    resized = [(i, e) for i, r in enumerate(reports.reports) for e in r.events if e.kind in ("shrink", "grow")]
    decided = [e for e in callback.events if e.kind in ("shrink", "grow") and e.step < len(reports.reports)]
    assert [e for _, e in resized] == decided and len(decided) >= 2
    for i, event in resized:
        assert event.step == i and reports.reports[i].micro_batch_size == event.after, (i, event)
        assert reports.reports[i - 1].micro_batch_size == event.before, (i, event)


class ReportRecorder(pl.Callback):
    """Keeps the step report the owner published at each optimizer step."""

    def __init__(self, owner: AutoMicroBatching) -> None:
        self.owner, self.reports = owner, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.reports.append(self.owner.last_step_report)


# ---- the cold start's pre-flight (issue 12, item 3) ------------------------------------------------------------------


class DataDependentModel(SplitTokenModel):
    """Reads a number from the batch in ``training_step``: fake tensors cannot trace it; real ones run unchanged."""

    def training_step(self, batch, batch_idx):
        keep = int(batch["mask"].sum() >= 0)  # always 1 for real, data-dependent for a trace
        return super().training_step({k: v[: keep * len(v)] for k, v in batch.items()}, batch_idx)


def test_the_cold_start_is_traced_and_starts_at_the_predicted_size(tmp_path, caplog):
    per_sample = 8 * (1 << 16) * 4
    model = ActivationHeavyModel(ballast_steps=range(0), ballast_bytes=0)
    from lightning_accum.memory.backends import CPUBackend

    budget = CPUBackend().current_bytes() + 24 * per_sample  # room for about 24 samples of the 64-sample step batch
    callback = AutoMicroBatching("auto", max_memory=budget, count_items=count_tokens)
    with caplog.at_level(logging.INFO, logger="lightning_accum"):
        make_trainer(tmp_path, [callback], max_steps=2).fit(model, DataLoader(TokenDataset(128), batch_size=64))
    found = callback.preflight_result
    assert found is not None and found.reason is None and sorted(found.peaks) == [16, 32]
    # Per sample, the trace sees the (T x width) activation and its mean's input: within 10% of the arithmetic.
    assert found.peak_model.per_sample_bytes == pytest.approx(per_sample, rel=0.1)
    assert 1 < model.step_sizes[0] < 64 and callback.oom_retries == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("lightning_accum: pre-flight traced micro-batches of 16 and 32") for m in messages)


def test_the_cold_start_falls_back_to_the_whole_step_batch_where_tracing_fails(tmp_path):
    callback = AutoMicroBatching("auto", count_items=count_tokens)
    model = DataDependentModel()
    with pytest.warns(
        UserWarning, match=r"pre-flight fell back to halving .*\(DataDependentOutputException: .*costs an out-of-memory"
    ):
        make_trainer(tmp_path, [callback], max_steps=1).fit(model, DataLoader(TokenDataset(16), batch_size=16))
    assert callback.preflight_result.peak_model is None
    assert model.micro_batch_sizes[0] == 16


def test_an_error_while_predicting_falls_back_instead_of_leaving_other_ranks_in_the_agreement(tmp_path):
    calls = []

    def batch_size_of(batch):  # fails once, inside the pre-flight: every rank must still reach its all-reduce
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("x")
        return len(batch["x"])

    callback = AutoMicroBatching(count_items=count_tokens, batch_size_of=batch_size_of)
    model = SplitTokenModel()
    with pytest.warns(UserWarning, match=r"pre-flight fell back to halving .*on fake tensors \(KeyError"):
        make_trainer(tmp_path, [callback], max_steps=1).fit(model, DataLoader(TokenDataset(16), batch_size=16))
    assert model.micro_batch_sizes[0] == 16


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"preflight": False}, "turned off"),
        ({"micro_batch_size": 8}, "an int size"),
        ({"predictive": False}, "halving"),
    ],
)
def test_no_preflight_runs_where_it_is_off_or_has_nothing_to_decide(tmp_path, kwargs, why):
    callback = AutoMicroBatching(count_items=count_tokens, **kwargs)
    make_trainer(tmp_path, [callback], max_steps=1).fit(SplitTokenModel(), DataLoader(TokenDataset(16), batch_size=16))
    assert callback.preflight_result is None, why


def test_a_resumed_run_keeps_its_size_and_traces_nothing(tmp_path):
    injector = OOMInjector(OOMFault(step=0, micro_batch=0, phase="forward"))
    callback = AutoMicroBatching(count_items=count_tokens, fault_injector=injector, oom_cooldown=50)
    trainer = make_trainer(tmp_path, [callback], max_steps=1)
    trainer.fit(SplitTokenModel(), DataLoader(TokenDataset(64), batch_size=16))
    assert callback.preflight_result is not None and callback.planner.micro_batch_size == 8  # traced 16; OOM: 8
    trainer.save_checkpoint(tmp_path / "split.ckpt")

    resumed_callback = AutoMicroBatching(count_items=count_tokens, oom_cooldown=50)
    resumed = SplitTokenModel()
    resumed_trainer = make_trainer(tmp_path, [resumed_callback], max_steps=5, max_epochs=2)
    resumed_trainer.fit(resumed, DataLoader(TokenDataset(64), batch_size=16), ckpt_path=tmp_path / "split.ckpt")
    assert resumed_callback.preflight_result is None
    assert max(resumed.micro_batch_sizes) == 8


def test_preflight_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`preflight` must be a bool, got 'yes'"):
        AutoMicroBatching(preflight="yes")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.5, 0.5), (8 * 2**30, 8 * 2**30), (8.0 * 2**30, 8 * 2**30), ("8GiB", 8 * 2**30), ("500 MB", 500 * 10**6)],
)
def test_max_memory_accepts_fractions_bytes_and_sizes(value, expected):
    # LightningCLI hands a YAML int such as 8589934592 over as a float; a whole number of bytes is still bytes.
    assert AutoMicroBatching(max_memory=value).max_memory == expected


def test_pinning_auto_names_the_users_argument():
    with pytest.raises(ValueError, match=r"`pin_micro_batch_size=True` needs an int `micro_batch_size`"):
        AutoMicroBatching(pin_micro_batch_size=True)


def test_a_shrink_releases_cached_memory_once_and_a_grow_releases_nothing(tmp_path, monkeypatch):
    # Memory the larger size freed would inflate the peak measured at the smaller one: a shrink releases it once,
    # without gc.collect() (half a second here). A grow has nothing to release.
    import lightning_accum.split.session as amb
    import lightning_accum.split.step as split_step

    calls: list[str] = []
    monkeypatch.setattr(amb, "release_cached_memory", lambda: calls.append("cached"))
    monkeypatch.setattr(split_step, "release_memory", lambda: calls.append("gc"))  # after an OOM only
    callback = AutoMicroBatching(8, max_memory=0.5)
    plan = iter([4, 4, 8, 8, 2, 2])  # the size each step's end plans for the next one

    def planned(size, peak_bytes, step, alloc_retries_delta=0):
        calls.append(f"step {step}")
        callback.planner._limit = next(plan)  # the planner's size limit, scripted here
        return callback.planner.micro_batch_size

    callback.planner.on_step = planned
    model = SplitTokenModel()
    make_trainer(tmp_path, [callback], max_steps=6).fit(model, DataLoader(TokenDataset(48), batch_size=8))
    assert model.micro_batch_sizes == [8, 4, 4, 4, 4, 8, 8, 2, 2, 2, 2]
    # Steps are counted from 1 at the end of a step (Lightning's global_step after the optimizer step).
    assert calls == ["step 1", "cached", "step 2", "step 3", "step 4", "step 5", "cached", "step 6"]


def test_gradient_clipping_sees_the_exact_step_gradient(tmp_path):
    callback = AutoMicroBatching(4, count_items=count_tokens)
    dataset = TokenDataset(48)
    model = SplitTokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, [callback], gradient_clip_val=0.3).fit(model, DataLoader(dataset, batch_size=16))
    unclipped = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert max(float(torch.cat([g.flatten() for g in s.values()]).norm()) for s in unclipped) > 0.3
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05, clip_norm=0.3)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_bf16_mixed_on_cpu(tmp_path):
    callback = AutoMicroBatching(4, count_items=count_tokens)
    model, expected, _ = fit_split(tmp_path, callback, precision="bf16-mixed")
    assert_grads_close(model.step_grads, expected, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed with GradScaler needs CUDA")
def test_16_mixed_with_grad_scaler_and_an_oom(tmp_path):
    injector = OOMInjector(OOMFault(step=1, micro_batch=1, phase="backward"), flavor="cuda")
    callback = AutoMicroBatching(4, count_items=count_tokens, fault_injector=injector)
    model, expected, _ = fit_split(tmp_path, callback, accelerator="cuda", precision="16-mixed")
    grads = [{n: g.cpu() for n, g in step.items()} for step in model.step_grads]
    assert callback.oom_retries == 1
    assert_grads_close(grads, expected, rtol=1e-2, atol=1e-3)


def test_lr_scheduler_steps_once_per_optimizer_step(tmp_path):
    class WithScheduler(SplitTokenModel):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    model = WithScheduler()
    injector = OOMInjector(OOMFault(step=1, micro_batch=0, phase="forward"))
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4, fault_injector=injector)])
    trainer.fit(model, DataLoader(TokenDataset(48), batch_size=16))
    # 3 steps (one retried after an OOM), so the learning rate halved exactly 3 times.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 2**3)


def test_resume_restores_the_planner(tmp_path):
    injector = OOMInjector(OOMFault(step=0, micro_batch=0, phase="forward"))
    callback = AutoMicroBatching(8, count_items=count_tokens, fault_injector=injector, oom_cooldown=50)
    dataset = TokenDataset(64)
    model = SplitTokenModel()
    trainer = make_trainer(tmp_path, [callback], max_steps=2)
    trainer.fit(model, DataLoader(dataset, batch_size=16))
    ckpt = tmp_path / "split.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed_callback = AutoMicroBatching(8, count_items=count_tokens, oom_cooldown=50)
    resumed = SplitTokenModel()
    resumed_trainer = make_trainer(tmp_path, [resumed_callback], max_steps=5, max_epochs=2)
    resumed_trainer.fit(resumed, DataLoader(dataset, batch_size=16), ckpt_path=ckpt)
    # The size that ran out of memory is still cooling down after the resume: the run goes on at 4, not 8.
    assert resumed.micro_batch_sizes and max(resumed.micro_batch_sizes) == 4
    assert resumed_callback.oom_retries == 1
    assert resumed_callback.consumed_samples == 16 * resumed_trainer.global_step > 32


def test_a_budget_that_no_size_can_meet_is_reported_once(tmp_path):
    callback = AutoMicroBatching(4, max_memory=2**20, min_micro_batch_size=2, count_items=count_tokens)
    with pytest.warns(UserWarning, match=r"over the budget \(1.00 MiB\) even at the smallest micro-batch size \(2\)"):
        model, expected, _ = fit_split(tmp_path, callback, n=64)
    assert_grads_close(model.step_grads, expected, **FP32)  # still exact, just not within budget


@pytest.mark.parametrize("max_memory", [2**50, "100TiB"])
def test_a_budget_larger_than_the_device_is_warned_about_with_both_figures(tmp_path, max_memory):
    # Taken without a word before (issue 18, item 10): the log read "memory budget 1048576.00 GiB of 23.54 GiB".
    callback = AutoMicroBatching(4, max_memory=max_memory, count_items=count_tokens)
    with pytest.warns(UserWarning, match=r"sets a budget of (1048576|102400)\.00 GiB, more than the device holds \(\d"):
        model, expected, _ = fit_split(tmp_path, callback)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_a_budget_within_the_device_is_not_warned_about(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*more than the device holds.*")
        fit_split(tmp_path, AutoMicroBatching(4, max_memory=0.5, count_items=count_tokens))


# ---- a micro-batch without loss-bearing items (issue 9, item 9) ------------------------------------------------------


class NaNOnEmptyModel(SplitTokenModel):
    """The usual masked mean, without a clamp: NaN (0 / 0) for a micro-batch with no loss-bearing token."""

    def training_step(self, batch, batch_idx):
        self.micro_batch_sizes.append(len(batch["x"]))
        per_token = (self.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        loss = (per_token * batch["mask"]).sum() / batch["mask"].sum()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class RecordWindowLoss(Callback):
    def __init__(self, owner: AutoMicroBatching) -> None:
        self.owner = owner
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        report = self.owner.last_step_report
        self.values.append(float(report.loss_sum) / float(report.loss_items))


def step_losses(dataset, step_indices, step_grads, lr=0.05):
    """The token mean the unsplit step batch has at each step's parameters (what it would log)."""
    reference = SplitTokenModel(lr=lr)
    losses = []
    for indices, grads in zip(step_indices, step_grads, strict=True):
        batch = {k: torch.stack([dataset[i][k] for i in indices]) for k in dataset[0]}
        with torch.no_grad():
            losses.append(float(token_loss(reference, batch)))
            for name, p in reference.named_parameters():
                p -= lr * grads[name]
    return losses


def test_a_micro_batch_without_items_contributes_nothing(tmp_path):
    # Micro-batches of 4: step 0's second and step 1's last micro-batch hold only padding.
    lengths = [0 if 4 <= i < 8 or 28 <= i < 32 else 1 + i % 8 for i in range(32)]
    dataset = TokenDataset(32, lengths=lengths)
    model = NaNOnEmptyModel(lr=0.05)
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(4, count_items=count_tokens)
    window_loss = RecordWindowLoss(callback)
    logger = CSVLogger(tmp_path, name="logs")
    trainer = make_trainer(tmp_path, [callback, window_loss], logger=logger, log_every_n_steps=1)
    trainer.fit(model, DataLoader(dataset, batch_size=16))

    expected_grads = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert_grads_close(model.step_grads, expected_grads, **FP32)  # not NaN: the empty micro-batch added nothing
    expected = step_losses(dataset, model.step_indices, expected_grads)
    assert window_loss.values == pytest.approx(expected, rel=1e-5)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["train_loss_step"]) for r in rows if r.get("train_loss_step")] == pytest.approx(expected, rel=1e-5)


# ---- an empty step batch (issue 9, item 17) --------------------------------------------------------------------------


def test_an_empty_step_batch_is_reported_as_such(tmp_path):
    dataset = TokenDataset(8)
    full = {k: torch.stack([dataset[i][k] for i in range(8)]) for k in dataset[0]}
    empty = {k: v[:0] for k, v in full.items()}  # e.g. a collate_fn that filtered out every sample
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4)])
    with pytest.raises(ValueError, match=r"step batch with 0 samples \(batch_idx=1\).*collate_fn"):
        trainer.fit(SplitTokenModel(), DataLoader([full, empty], batch_size=None))


# ---- accumulation set elsewhere (issue 9, item 5) --------------------------------------------------------------------


def test_lightnings_gradient_accumulation_scheduler_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4), GradientAccumulationScheduler({0: 2})])
    with pytest.raises(
        RuntimeError, match=r"`GradientAccumulationScheduler` cannot be combined with `AutoMicroBatching`"
    ):
        trainer.fit(SplitTokenModel(), DataLoader(TokenDataset(32), batch_size=8))


class SetAccumulationAtEpoch1(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.accumulate_grad_batches = 3


def test_accumulate_grad_batches_set_later_is_refused_before_the_step(tmp_path):
    model = SplitTokenModel()
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4), SetAccumulationAtEpoch1()], max_epochs=2)
    with pytest.raises(ValueError, match=r"`trainer.accumulate_grad_batches` became 3 at epoch 1"):
        trainer.fit(model, DataLoader(TokenDataset(32), batch_size=8))
    assert trainer.global_step == 4  # epoch 0 trained; nothing of epoch 1 was stepped with a wrong window


# ---- the run config (issue 9, item 19) -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "given"),
    [
        (
            {},
            {
                "micro_batch_size": "auto",
                "max_memory": None,
                "min_micro_batch_size": 1,
                "count_items": "samples",
                "loss_reduction": "mean",
                "pin_micro_batch_size": False,
                "low_watermark": 0.7,
                "grow_patience": 20,
                "oom_cooldown": 200,
                "predictive": True,
                "gradient_sync": "deferred",
                "preflight": True,
            },
        ),
        (
            {
                "micro_batch_size": 8,
                "max_memory": "8GiB",
                "min_micro_batch_size": 2,
                "count_items": count_tokens,
                "loss_reduction": "sum",
                "pin_micro_batch_size": True,
                "low_watermark": 0.5,
                "grow_patience": 3,
                "oom_cooldown": 7,
                "predictive": False,
                "gradient_sync": "overlap",
                "preflight": False,
            },
            {"count_items": "count_tokens"},
        ),
    ],
    ids=["defaults", "every-argument"],
)
def test_settings_hold_every_argument(tmp_path, kwargs, given):
    callback = AutoMicroBatching(**kwargs)
    make_trainer(tmp_path, [callback]).fit(SplitTokenModel(), DataLoader(TokenDataset(16), batch_size=8))
    settings = callback.settings()
    capacity = settings["memory_capacity_bytes"]
    expected = {"mode": "split", **kwargs, **given, "memory_capacity_bytes": capacity}
    expected |= {"split_batch": "the built-in rules", "batch_size_of": "the built-in rules"}
    expected["budget_bytes"] = 8 * 2**30 if kwargs else int(0.9 * capacity)
    assert settings == expected


# ---- batch norm (issue 9, item 20) -----------------------------------------------------------------------------------


class BatchNormModel(SplitTokenModel):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(5)

    def training_step(self, batch, batch_idx):
        x = self.norm(batch["x"].transpose(1, 2)).transpose(1, 2)
        return super().training_step({**batch, "x": x}, batch_idx)


def test_batch_norm_layers_are_warned_about_once(tmp_path):
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4)])
    with pytest.warns(UserWarning, match=r"batch-norm layers \(norm: BatchNorm1d\).*GroupNorm or LayerNorm") as record:
        trainer.fit(BatchNormModel(), DataLoader(TokenDataset(32), batch_size=16))
    assert sum("batch-norm" in str(w.message) for w in record) == 1


def test_a_model_without_batch_norm_gets_no_such_warning(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [AutoMicroBatching(4)]).fit(
            SplitTokenModel(), DataLoader(TokenDataset(16), batch_size=8)
        )
    assert not [w for w in record if "batch-norm" in str(w.message)]


@pytest.mark.parametrize(
    ("gradient_sync", "world_size", "backend", "minutes", "warns"),
    [
        ("overlap", 8, "nccl", 30, True),  # Lightning's default timeout: the others could wait half an hour
        ("overlap", 8, "nccl", 5, False),  # bounded by the user
        ("overlap", 8, "gloo", 30, False),  # gloo notices the closed connection at once
        ("deferred", 8, "nccl", 30, False),  # an OOM anywhere is retried: nobody waits
        ("overlap", 1, "nccl", 30, False),
    ],
)
def test_overlap_under_nccl_with_a_long_timeout_is_warned_about(gradient_sync, world_size, backend, minutes, warns):
    from datetime import timedelta

    from lightning_accum import _compat
    from lightning_accum.split.sync import overlap_wait_warning
    from tests.helpers import ddp_strategy

    timeout = _compat.process_group_timeout(ddp_strategy(timeout=timedelta(minutes=minutes)))
    assert timeout == timedelta(minutes=minutes)
    warning = overlap_wait_warning(gradient_sync, world_size, backend, timeout)
    assert (warning is not None) == warns
    if warns:
        assert "(0:30:00)" in warning and "DDPStrategy(timeout=timedelta(minutes=5))" in warning
        assert "gradient_sync='deferred'" in warning


# ---- split by tokens with the sample count ---------------------------------------------------------------------------


def fit_by_tokens(tmp_path, fits=1, **kwargs):
    """Fit a token-mean causal LM split by tokens (``fits`` fits, a Trainer each): its gradients, and the exact ones."""
    from lightning_accum.sequences import PaddedSequences
    from tests.token_models import TinyCausalLM, TokenSequences, full_batch_reference, lognormal_lengths, pad_right

    dataset = TokenSequences(lognormal_lengths(32, seed=2), seed=1)
    callback = AutoMicroBatching(
        sequences=PaddedSequences(), micro_batch_tokens=96, pin_micro_batch_size=True, **kwargs
    )
    for fit in range(fits):
        model = TinyCausalLM(lr=0.1)
        initial = copy.deepcopy(model)
        trainer = make_trainer(tmp_path / str(fit), [callback])
        trainer.fit(model, DataLoader(dataset, batch_size=16, collate_fn=pad_right))
    return model.step_grads, full_batch_reference(initial, dataset, model.step_indices, lr=0.1)


def test_split_by_tokens_with_the_sample_count_warns_once_and_is_off(tmp_path):
    with pytest.warns(UserWarning, match=r"`count_items` is None .* with `sequences=PaddedSequences\(") as record:
        grads, expected = fit_by_tokens(tmp_path, fits=2)
    warned = [str(w.message) for w in record if "`count_items` is None" in str(w.message)]
    assert len(warned) == 1, warned  # once, not once per fit
    assert 'count_items=CountTokens("labels", shift=1)' in warned[0]
    assert (
        "count_items: {class_path: lightning_accum.items.CountTokens, init_args: {key: labels, shift: 1}}"
        in (warned[0])
    )
    # What the warning is about: the micro-batches' token means weighted by their samples are not the step's mean.
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_grads_close(grads, expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"counter": "tokens"}, id="CountTokens"),
        pytest.param({"counter": "samples"}, id="CountSamples: the user says samples"),
        pytest.param({"loss_reduction": "sum"}, id="a summed loss: the count only scales it"),
    ],
)
def test_split_by_tokens_with_a_counter_does_not_warn(tmp_path, kwargs):
    from lightning_accum.items import CountSamples, CountTokens

    counter = kwargs.pop("counter", None)
    if counter is not None:
        kwargs["count_items"] = CountTokens("labels", shift=1) if counter == "tokens" else CountSamples()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        grads, expected = fit_by_tokens(tmp_path, **kwargs)
    assert not [w for w in record if "`count_items`" in str(w.message)]
    if counter == "tokens":  # the fix the warning names is exact
        assert_grads_close(grads, expected, rtol=1e-5, atol=1e-6)
