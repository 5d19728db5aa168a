"""What a user reads about a run split by tokens: events that name tokens, none after the last step, no shrinking
below the floor the planner has announced (issue 25, items 7, 8 and 9).

The device is a fake whose peak is a fixed part plus a cost per padded token of the micro-batch, so the planner's
decisions follow from the test's numbers; the model is a real causal LM and the step a real split-mode step.
"""

from __future__ import annotations

import logging
import warnings

from torch.utils.data import DataLoader

from lightning_accum import AccumulationMonitor, AutoMicroBatching
from lightning_accum.items import CountTokens
from lightning_accum.sequences import PaddedSequences
from tests import helpers as h
from tests.test_split_faults import FakeBackend
from tests.token_models import TinyCausalLM, TokenSequences, pad_right

PER_TOKEN = 2**16  # bytes a padded token costs on the fake device
FIXED = 2**24  # bytes that do not depend on the micro-batch


class MeteredLM(TinyCausalLM):
    """Each micro-batch peaks at ``fixed + PER_TOKEN * padded tokens`` on ``backend``."""

    def __init__(self, backend: FakeBackend, fixed: int = FIXED) -> None:
        super().__init__(lr=0.05)
        self.backend, self.fixed = backend, fixed

    def training_step(self, batch, batch_idx):
        self.backend.allocate(self.fixed + PER_TOKEN * batch["input_ids"].numel())
        return super().training_step(batch, batch_idx)


def fit(tmp_path, monkeypatch, lengths, *, step_batch, steps, fixed=FIXED, **kwargs):
    backend = FakeBackend(capacity=2**34)
    monkeypatch.setattr("lightning_accum.split.session.backend_for", lambda device: backend)
    callback = AutoMicroBatching(
        sequences=PaddedSequences(), count_items=CountTokens("labels", shift=1), preflight=False, **kwargs
    )
    model = MeteredLM(backend, fixed)
    trainer = h.make_trainer(tmp_path, [callback, AccumulationMonitor()], max_steps=steps)
    trainer.fit(model, DataLoader(TokenSequences(lengths, seed=1), batch_size=step_batch, collate_fn=pad_right))
    return callback, trainer


def test_token_budget_events_name_tokens_and_none_is_logged_after_the_last_step(tmp_path, monkeypatch, caplog):
    # 16 sequences of 8 tokens a step, 128 tokens in all. At 32 tokens the peak (4 + 2 MiB) is under the low
    # watermark of a budget worth 128 tokens (0.7 x 12 MiB), and so is it at 64 (8 MiB): the planner grows the budget
    # after step 0 and again after step 1, the last one, for a step that never runs.
    fixed = 2**22
    caplog.set_level(logging.INFO, logger="lightning_accum")
    callback, _trainer = fit(
        tmp_path, monkeypatch, [8] * 48, step_batch=16, steps=2, fixed=fixed, micro_batch_tokens=32,
        max_memory=fixed + 128 * PER_TOKEN, grow_patience=1,
    )  # fmt: skip
    assert callback.planner.micro_batch_size == 128  # the planner did decide the second grow
    grows = [e for e in callback.events if e.kind == "grow"]
    assert [(e.step, e.before, e.after) for e in grows] == [(1, 32, 64)]
    assert grows[0].unit == "tokens"
    lines = [r.getMessage() for r in caplog.records if "memory freed" in r.getMessage()]
    assert lines == [f"lightning_accum: token budget (memory freed) 32 -> 64 tokens at step 1 ({grows[0].reason})"]
    # The step that ran with it carries it, for the monitor; no step after the last one does.
    assert callback.last_step_report is not None and callback.last_step_report.events == tuple(grows)


def test_a_token_budget_shrink_says_tokens(tmp_path, monkeypatch, caplog):
    budget = FIXED + 40 * PER_TOKEN  # 16 x 8 tokens does not fit
    caplog.set_level(logging.INFO, logger="lightning_accum")
    callback, _ = fit(
        tmp_path, monkeypatch, [8] * 32, step_batch=16, steps=2, micro_batch_tokens=128, max_memory=budget
    )
    shrinks = [e for e in callback.events if e.kind == "shrink"]
    assert shrinks and shrinks[0].before == 128
    assert any(
        r.getMessage().startswith(f"lightning_accum: token budget (memory pressure) 128 -> {shrinks[0].after} tokens")
        for r in caplog.records
    )


def test_over_the_budget_at_the_smallest_token_budget_holds_it_and_says_so_once(tmp_path, monkeypatch):
    # Step 0's longest sequence is 48 tokens, and the budget starts there: its floor. The fixed memory alone is over
    # the budget. Step 1's longest is 20: a budget of 20 would be "above the floor" of that step, but shrinking was
    # just said to be useless.
    lengths = [48, 10, 10, 10, 20, 5, 5, 5, 30, 6, 6, 6]
    budget = FIXED - 2**20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, _trainer = fit(
            tmp_path, monkeypatch, lengths, step_batch=4, steps=3, micro_batch_tokens=48, max_memory=budget
        )
    said = [w for w in caught if "even at the smallest token budget (48)" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert not [e for e in callback.events if e.kind == "shrink"], callback.events
    assert callback.planner.micro_batch_size == 48  # the budget stayed at the floor it was announced at
    assert callback.last_step_report is not None and callback.last_step_report.micro_batch_tokens == 48
