"""The probe in tokens (issue 21): ``peak = fixed + T (a + c L)`` fitted at several lengths, checked on held-out shapes.

The test model's eager attention keeps the scores of every pair of positions, a ``T x L`` term a fit in tokens alone
cannot follow; its fused (SDPA) attention has none. Each fit is checked against a shape measured outside the grid.
"""

from __future__ import annotations

import dataclasses
import functools

import jsonargparse
import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_accum import AutoMicroBatching
from lightning_accum.items import CountTokens
from lightning_accum.probe import measure, present
from lightning_accum.probe.measure import _Where
from lightning_accum.probe.resolve import module_factory
from lightning_accum.probe.token_result import TokenMeasurement
from lightning_accum.probe.tokens import _micro_batches, _plan, probe_tokens
from lightning_accum.probe.training_process import measure_training_process
from lightning_accum.sequences import PaddedSequences
from tests.probe.models import RegressionData, TokenLM, token_batch
from tests.test_token_split import cheapest_cut

KiB, MiB = 2**10, 2**20
LENGTHS = [64, 40, 30, 20, 12, 10, 8, 5]  # the step batch's real lengths, padded to 64
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
GRID = {"batch_size": 8, "sequence_lengths": (16, 32, 64), "fit_micro_batch_sizes": (1, 2, 4)}


def _data(seq_len: int = 64):
    return functools.partial(token_batch, seq_len=seq_len, lengths=LENGTHS)


def _on_top_of_the_process(result):
    """``result`` with a budget of 1 MiB of tensors beyond what a training process's resident set holds without them."""
    kept = result.resident_overhead_bytes + result.process_overhead_bytes
    return dataclasses.replace(result, budget_bytes=MiB + kept)


@pytest.fixture(scope="module")
def eager():
    return _on_top_of_the_process(probe_tokens(TokenLM, _data(), **GRID, budget_bytes=MiB))


@pytest.fixture(scope="module")
def fused():
    return _on_top_of_the_process(
        probe_tokens(functools.partial(TokenLM, attention="sdpa"), _data(), **GRID, budget_bytes=MiB)
    )


def _measured_outside_the_grid(attention: str, length: int, samples: int, device: str = "cpu") -> TokenMeasurement:
    """One shape measured on its own, with the probe's own loop: the reference the fit must predict."""
    plan = _plan(PaddedSequences(), lambda start, size: _data()(size), 8, [length], [1, samples])
    where = _Where.of(device, None, "32-true")
    make_module = module_factory(functools.partial(TokenLM, attention=attention), None)
    run, _, _ = measure._measure(make_module, _micro_batches(plan, 1, length), samples, 2, 1, 1, where, 0)
    return TokenMeasurement.of(run, length)


def test_eager_attention_has_a_token_times_length_term_that_the_fit_separates(eager):
    fixed, a, c = eager.coefficients
    # Each layer of eager attention keeps scores and probabilities of 4 heads x L positions per token, in float32.
    assert 2 * 4 * 4 <= c <= 4 * 4 * 4, c
    assert a > 0 and fixed > 0
    assert eager.holdout_error < 0.05
    assert eager.tokens_only_holdout_error > 2 * eager.holdout_error  # the length matters, and the fit knows it
    # A shape outside the grid (T = 3 x 48): the fit predicts it, a per-token cost at the longest length does not.
    reference = _measured_outside_the_grid("eager", 48, 3)
    predicted = eager.passes_bytes(reference.tokens, 48)
    torch.testing.assert_close(predicted, float(reference.passes_peak_bytes), rtol=0.05, atol=0)
    at_longest = fixed + reference.tokens * (a + c * 64)
    assert abs(at_longest / reference.passes_peak_bytes - 1) > 0.05


def test_fused_attention_costs_the_same_per_token_at_every_length(fused):
    _, a, c = fused.coefficients
    assert c * 64 < 0.02 * a, (a, c)  # the fused kernel keeps a few floats per query, not L of them
    assert fused.holdout_error < 0.02
    reference = _measured_outside_the_grid("sdpa", 48, 3)
    torch.testing.assert_close(
        fused.passes_bytes(reference.tokens, 48), float(reference.passes_peak_bytes), rtol=0.02, atol=0
    )


def test_meta_predicts_what_the_cpu_measures():
    kwargs = {**GRID, "sequence_lengths": (16, 64), "fit_micro_batch_sizes": (1, 2)}
    cpu = probe_tokens(TokenLM, _data(), **kwargs)
    meta = probe_tokens(TokenLM, _data(), device="meta", **kwargs)
    assert [(m.length, m.samples) for m in meta.measurements] == [(16, 1), (16, 2), (64, 1), (64, 2)]
    for measured, predicted in zip(cpu.measurements, meta.measurements, strict=True):
        torch.testing.assert_close(float(predicted.peak_bytes), float(measured.peak_bytes), rtol=0.05, atol=0)
    torch.testing.assert_close(meta.coefficients, cpu.coefficients, rtol=0.05, atol=1.0)
    assert meta.device == "meta (as cpu)" and "Predicted on fake tensors" in present.table(meta)


def test_the_token_budget_is_the_largest_that_fits(eager):
    usable = eager.usable_bytes
    for length in eager.lengths:
        tokens = eager.fitting_tokens_at(length)
        if tokens == 8 * length:  # the whole step batch fits in one micro-batch
            assert eager.passes_bytes(tokens, length) <= usable
            continue
        assert eager.passes_bytes(tokens, length) <= usable < eager.passes_bytes(tokens + 1, length)
    assert eager.fitting_micro_batch_tokens == eager.fitting_tokens_at(64)
    # Per token, shorter sequences cost less under eager attention, so as many tokens fit, or the whole step batch.
    for length in (16, 32):
        assert eager.fitting_tokens_at(length) >= min(eager.fitting_tokens_at(64), 8 * length)
    fixed, a, c = eager.coefficients
    longest = eager.longest_alone()
    assert fixed + longest * (a + c * longest) <= usable < fixed + (longest + 1) * (a + c * (longest + 1))


def test_budgets_that_fit_nothing_say_why(eager):
    overhead = eager.resident_overhead_bytes + eager.process_overhead_bytes
    small = dataclasses.replace(eager, budget_bytes=eager.optimizer_peak_bytes - 1 + overhead)
    assert small.fitting_micro_batch_tokens is None and present.snippet(small) is None
    assert any("the optimizer step alone peaks at" in line for line in present.findings(small))
    # A sequence of 64 does not fit.
    short = dataclasses.replace(eager, budget_bytes=eager.passes_bytes(64, 64) - 1 + overhead)
    assert short.fitting_tokens_at(64) is None and 32 <= short.longest_alone() < 64
    line = next(line for line in present.findings(short) if "not even one sequence of L=64 fits" in line)
    assert f"the longest sequence that fits alone has {short.longest_alone()} tokens" in line
    # The budget is then for the longest length that fits, and the snippet says what to do with longer sequences.
    assert short.recommended_length == 32 and short.fitting_micro_batch_tokens == short.fitting_tokens_at(32)
    assert present.snippet(short).startswith(f"# No sequence over {short.longest_alone()} tokens fits even alone")


def test_what_the_step_batch_costs_by_samples_and_by_tokens(eager):
    tokens = eager.fitting_micro_batch_tokens
    cost = eager.step_batch(tokens)
    b = tokens // 64
    assert (cost.micro_batch_size, cost.by_samples_micro_batches) == (b, -(-8 // b))
    assert cost.by_samples_tokens == 8 * 64 and cost.real_tokens == sum(LENGTHS)
    groups = cheapest_cut(sorted(LENGTHS, reverse=True), tokens)  # the cut split mode makes at this budget
    assert cost.by_tokens_micro_batches == len(groups)
    assert cost.by_tokens_tokens == sum(len(g) * g[0] for g in groups)
    assert cost.by_tokens_padding == pytest.approx(1 - sum(LENGTHS) / cost.by_tokens_tokens)
    assert cost.by_tokens_padding < cost.by_samples_padding == pytest.approx(1 - sum(LENGTHS) / 512)


def test_one_length_cannot_separate_the_terms_and_says_so():
    result = probe_tokens(TokenLM, _data(), batch_size=8, sequence_lengths=(32,), fit_micro_batch_sizes=(1, 2, 4))
    assert result.coefficients[2] == 0 and result.holdout_error is None
    assert any("cannot be told from the T term" in line and "two or more" in line for line in present.findings(result))


def test_the_snippet_builds_the_callback_in_python_and_in_lightning_cli_yaml(eager, monkeypatch):
    monkeypatch.setattr("sys.argv", ["probe"])  # LightningCLI warns when pytest's own argv would mix with `args`
    python, _, config = present.snippet(eager).partition("# or in a LightningCLI config:\n")
    namespace: dict = {"AutoMicroBatching": AutoMicroBatching}
    exec(python.replace("AutoMicroBatching(", "callback = AutoMicroBatching(", 1), namespace)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[pl.Callback])
    parsed = parser.parse_object({"callbacks": yaml.safe_load(config)["trainer"]["callbacks"]})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    from_yaml = instantiate(parsed).callbacks[0]
    # The whole config through a real LightningCLI, as a user pastes it.
    cli = LightningCLI(
        TokenLM,
        RegressionData,
        run=False,
        args={**yaml.safe_load(config), "trainer": {**yaml.safe_load(config)["trainer"], **QUIET}},
        save_config_callback=None,
    )
    (from_cli,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    for callback in (namespace["callback"], from_yaml, from_cli):
        assert callback.sequences == PaddedSequences(mask="attention_mask")
        assert callback.planner.micro_batch_size_setting == eager.fitting_micro_batch_tokens
        assert callback.max_memory == eager.budget_bytes
        # Split by tokens, a token-mean loss needs the tokens counted (the sample default warns at setup).
        assert callback.count_items == CountTokens("labels", shift=1)
    assert yaml.safe_load(config)["data"] == {"batch_size": 8} and cli.datamodule.batch_size == 8


def test_the_json_is_in_bytes(eager):
    data = present.to_dict(eager)
    fixed, a, c = eager.coefficients
    assert (data["fit"]["fixed_bytes"], data["fit"]["per_token_bytes"], data["fit"]["per_token_length_bytes"]) == (
        fixed,
        a,
        c,
    )
    assert data["unit"] == "tokens"
    assert data["fit"]["holdout_relative_error"] == eager.holdout_error
    assert data["measurements"][0] == {
        "length": 16,
        "micro_batch_size": 1,
        "tokens": 16,
        "peak_bytes": eager.measurements[0].peak_bytes,
        "passes_peak_bytes": eager.measurements[0].passes_peak_bytes,
        "optimizer_peak_bytes": eager.measurements[0].optimizer_peak_bytes,
        "breakdown": eager.measurements[0].breakdown,
        "peak_phase": eager.measurements[0].peak_phase,
        "device_peak_bytes": None,
        "resident_passes_peak_bytes": eager.measurements[0].resident_passes_peak_bytes,
        "resident_optimizer_peak_bytes": eager.measurements[0].resident_optimizer_peak_bytes,
    }
    assert data["fitting_tokens_by_length"]["64"] == eager.fitting_micro_batch_tokens
    assert data["step_batch"]["real_tokens"] == sum(LENGTHS)


def test_the_table_reads_in_one_unit_and_names_the_shapes(eager, tmp_path):
    table = present.table(eager)
    assert table.startswith("Peak live tensor memory in MiB on cpu, 32-true, by tokens")
    assert table.count("held out") == len(eager.holdout_shapes) == 4
    assert "Ready to paste (split mode by tokens):" in table
    assert present.plot(eager, tmp_path / "tokens.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sequence_lengths": (128,)}, ValueError, r"`sequence_lengths` holds 128, but .* padded to 64 positions"),
        ({"fit_micro_batch_sizes": (16,)}, ValueError, r"`fit_micro_batch_sizes` holds 16, more sequences than"),
        ({"sequence_lengths": (0,)}, ValueError, r"`sequence_lengths` must be an int >= 1, got 0"),
        (
            {"sequence_lengths": (32,), "fit_micro_batch_sizes": (2,)},
            ValueError,
            r"micro-batches of one token count \(64\); the fit needs two",
        ),
        ({"sequences": PaddedSequences(mask="mask")}, ValueError, r"`sequences`: .*the batch has no 'mask'"),
        ({"sequences": "attention_mask"}, TypeError, r"`sequences` must be a `lightning_accum.sequences.Padded"),
        ({"headroom": 1.0}, ValueError, r"`headroom` must be a fraction in \[0, 1\)"),
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be an int >= 0, got -1"),
        ({"devcie": "cpu"}, TypeError, r"`probe_tokens\(\)` got an unexpected keyword argument `devcie='cpu'`"),
        ({"process_overhead": -1}, ValueError, r"`process_overhead` must be an int >= 0, got -1"),
        ({"process_overhead": "lots"}, TypeError, r"`process_overhead` must be an int >= 0, got 'lots'.*\"measure\""),
    ],
)
def test_bad_arguments_are_named_before_anything_is_measured(monkeypatch, kwargs, error, match):
    monkeypatch.setattr(measure, "_measure", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(error, match=match):
        probe_tokens(TokenLM, _data(), **{"batch_size": 8, **kwargs})


def test_on_the_cpu_the_budget_is_in_the_planners_own_measure_the_resident_set(eager, monkeypatch):
    # Split mode's planner reads the CPU's memory through `CPUBackend` (the process's peak resident set); the probe
    # reads the same backend over each phase, and keeps what it holds beyond the live tensors out of the budget.
    from lightning_accum.memory import backends

    assert isinstance(backends.backend_for(torch.device("cpu")), backends.CPUBackend)
    read = []
    original = backends.CPUBackend.peak_bytes
    monkeypatch.setattr(backends.CPUBackend, "peak_bytes", lambda self: read.append(1) or original(self))
    measured = _measured_outside_the_grid("eager", 32, 2)
    assert read and measured.resident_passes_peak_bytes is not None and measured.resident_optimizer_peak_bytes
    assert eager.measure == "resident set"
    for m in eager.measurements:  # the resident set holds every live tensor, and the interpreter besides
        assert m.resident_passes_peak_bytes >= m.passes_peak_bytes
    overhead = max(m.resident_passes_peak_bytes - m.passes_peak_bytes for m in eager.measurements)
    assert eager.resident_overhead_bytes == overhead > 0
    assert eager.usable_bytes == eager.budget_bytes - overhead - eager.process_overhead_bytes
    assert any(
        "holds the process's peak resident set (VmHWM) to `max_memory`" in line for line in present.findings(eager)
    )
    # On fake tensors (no process to measure) the budget is live tensors, as before.
    meta = probe_tokens(TokenLM, _data(), **GRID, budget_bytes=MiB, device="meta")
    assert meta.measure == "live tensors" and meta.resident_overhead_bytes == 0 and meta.usable_bytes == MiB


def test_the_budget_keeps_free_what_a_training_process_holds_beyond_the_probes(eager, monkeypatch):
    # Issue 36, item 2: a user's Trainer process held about 495 MiB before any tensor, the probe's 434-460, and the
    # probe's token budget ended its first training step at 101% of the budget. The probe now measures that difference
    # in two fresh processes that run the same tiny model, under a Trainer with its loggers and by hand.
    measured = measure_training_process()
    assert measured.trainer_bytes > 100 * MiB and measured.by_hand_bytes > 100 * MiB  # an interpreter with torch
    assert measured.overhead_bytes == max(0, measured.trainer_bytes - measured.by_hand_bytes)
    assert "CSVLogger" in measured.loggers
    assert eager.process_overhead_source == "measured" and eager.process_overhead_bytes == measured.overhead_bytes
    assert (eager.training_process_bytes, eager.by_hand_process_bytes) == (
        measured.trainer_bytes,
        measured.by_hand_bytes,
    )
    assert eager.usable_bytes == eager.budget_bytes - eager.resident_overhead_bytes - measured.overhead_bytes
    (line,) = [line for line in present.findings(eager) if line.startswith("A training process holds more")]
    assert "under a Trainer with CSVLogger" in line and "`--process-overhead` sets it" in line
    # What is kept comes off the token budget, one for one.
    roomy = dataclasses.replace(eager, budget_bytes=eager.resident_overhead_bytes + MiB, process_overhead_bytes=0)
    kept = dataclasses.replace(roomy, process_overhead_bytes=256 * KiB)
    assert kept.usable_bytes == roomy.usable_bytes - 256 * KiB
    assert kept.fitting_micro_batch_tokens < roomy.fitting_micro_batch_tokens
    assert present.to_dict(kept)["process_overhead_bytes"] == 256 * KiB


@pytest.mark.parametrize(("given", "kept", "source"), [(3 * MiB, 3 * MiB, "given"), (None, 0, None), (0, 0, None)])
def test_a_given_process_overhead_is_kept_without_measuring(monkeypatch, given, kept, source):
    import lightning_accum.probe.tokens as tokens

    monkeypatch.setattr(tokens, "measure_training_process", lambda: pytest.fail("measured, though it was given"))
    grid = {"batch_size": 8, "sequence_lengths": (16, 32), "fit_micro_batch_sizes": (1, 2)}
    result = probe_tokens(TokenLM, _data(), **grid, budget_bytes=2**30, process_overhead=given)
    assert (result.process_overhead_bytes, result.process_overhead_source) == (kept, source)
    assert result.usable_bytes == 2**30 - result.resident_overhead_bytes - kept
    if given:
        assert any("keeps 3.00 MiB more free, as given" in line for line in present.findings(result))
    else:
        assert any("none of it is kept free here (`--process-overhead 0`)" in line for line in present.findings(result))


def test_a_training_process_that_cannot_be_measured_is_a_warning_not_a_failure(monkeypatch):
    import lightning_accum.probe.tokens as tokens

    def fails():
        raise RuntimeError("the trainer process failed (exit 1): ImportError")

    monkeypatch.setattr(tokens, "measure_training_process", fails)
    grid = {"batch_size": 8, "sequence_lengths": (16, 32), "fit_micro_batch_sizes": (1, 2)}
    match = r"could not be measured \(the trainer process failed .*Pass `process_overhead`"
    with pytest.warns(UserWarning, match=match):
        result = probe_tokens(TokenLM, _data(), **grid, budget_bytes=2**30)
    assert (result.process_overhead_bytes, result.process_overhead_source) == (0, "unmeasured")
    assert result.fitting_micro_batch_tokens is not None
    assert any("none of it is kept free here (it could not be measured)" in line for line in present.findings(result))
