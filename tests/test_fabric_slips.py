"""Issue 35: what a hand-written Fabric loop gets wrong by mistake is refused or handled exactly, never trained.

Each case is a slip a user makes in their own loop: a backward one indent out, `fabric.backward` where
`acc.backward` belongs, a backward with no micro-batch, a skipped backward, a save inside a window, a `loss_fn`
that back-propagates itself, a token budget of the wrong type.
"""

from __future__ import annotations

import pytest
import torch

from lightning_accum import FabricAccumulation, FabricMicroBatching
from lightning_accum.sequences import PaddedSequences
from tests.helpers import count_tokens
from tests.test_fabric import LOADER, batch_of, loss_fn, reference_grad, setup

OUTSIDE = r"`acc.backward\(loss\)` ran (after its micro-batch ended|before any micro-batch).*Indent the backward"


def test_a_backward_one_indent_out_is_refused_not_trained():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 3, count_items=count_tokens)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=OUTSIDE):
        for indices in acc.batches(LOADER):
            with acc.micro_batch(batch_of(indices)):
                loss = loss_fn(model, batch_of(indices))
            acc.backward(loss)  # the slip: one indent out
            if acc.should_step:
                optimizer.step()
                optimizer.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_backward_one_indent_out_in_a_short_last_window_is_refused_too():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 3, count_items=count_tokens)
    for indices in LOADER[:6]:  # two whole windows, run right
        with acc.micro_batch(batch_of(indices)):
            acc.backward(loss_fn(model, batch_of(indices)))
    with acc.micro_batch(batch_of(LOADER[6]), last=True):  # the epoch's short last window of one
        loss = loss_fn(model, batch_of(LOADER[6]))
    with pytest.raises(RuntimeError, match=OUTSIDE):
        acc.backward(loss)


def test_fabric_backward_inside_a_micro_batch_is_refused():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 3)
    with pytest.raises(RuntimeError, match=r"`fabric.backward\(loss\)` ran inside .*Call `acc.backward\(loss\)`"):
        with acc.micro_batch(batch_of(LOADER[0])):
            fabric.backward(loss_fn(model, batch_of(LOADER[0])))
    assert all(p.grad is None for p in model.parameters())  # refused before any gradient
    fabric.backward(loss_fn(model, batch_of(LOADER[0])))  # outside a window, Fabric's own backward is the user's


def test_acc_backward_with_no_micro_batch_is_refused():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 2)
    with pytest.raises(RuntimeError, match=r"`acc.backward\(loss\)` ran before any micro-batch"):
        acc.backward(loss_fn(model, batch_of(LOADER[0])))


def test_a_second_backward_in_one_micro_batch_is_refused():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 2)
    with pytest.raises(RuntimeError, match=r"a second time in one micro-batch"):
        with acc.micro_batch(batch_of(LOADER[0])):
            acc.backward(loss_fn(model, batch_of(LOADER[0])))
            acc.backward(loss_fn(model, batch_of(LOADER[0])))


def test_a_skipped_backward_counts_nothing_and_the_step_is_the_mean_over_what_ran():
    fabric, model, optimizer, reference = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 3, count_items=count_tokens)
    ran: list[int] = []
    steps = 0
    for position, indices in enumerate(acc.batches(LOADER)):
        with acc.micro_batch(batch_of(indices)):
            loss = loss_fn(model, batch_of(indices))
            if position != 1:  # the loop skips one micro-batch's backward (a non-finite loss, say)
                acc.backward(loss)
                ran += indices
        if acc.should_step:
            for p, r in zip(model.module.parameters(), reference_grad(reference, ran), strict=True):
                torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)
            optimizer.step()
            optimizer.zero_grad()
            ran, steps = [], steps + 1
    assert steps == 3


def test_a_window_whose_every_backward_was_skipped_skips_its_step(caplog):
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 2)
    with caplog.at_level("INFO", logger="lightning_accum"):
        for indices in LOADER[:2]:
            with acc.micro_batch(batch_of(indices)):
                loss_fn(model, batch_of(indices))  # no backward at all
    assert not acc.should_step
    assert all(p.grad is None for p in model.parameters())
    assert "has no items; optimizer step skipped" in caplog.text


def test_saving_inside_a_window_counts_the_micro_batches_that_ran():
    fabric, model, optimizer, _ = setup()
    acc = FabricAccumulation(fabric, model, optimizer, 3)
    with acc.micro_batch(batch_of(LOADER[0])):
        acc.backward(loss_fn(model, batch_of(LOADER[0])))
    with pytest.raises(RuntimeError, match=r"inside a window \(1 micro-batch of 3 run\)"):
        acc.state_dict()


@pytest.mark.parametrize("preflight", [True, False])
def test_a_loss_fn_that_calls_fabric_backward_is_refused_with_what_to_do(preflight):
    fabric, model, optimizer, _ = setup()
    acc = FabricMicroBatching(fabric, model, optimizer, 4, preflight=preflight, count_items=count_tokens)

    def carried_over(model, batch):  # from a plain Fabric loop, where the loss function also back-propagated
        loss = loss_fn(model, batch)
        fabric.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match=r"`loss_fn` called `fabric.backward`.*Return the loss from `loss_fn`"):
        acc.step(batch_of(range(8)), carried_over)


@pytest.mark.parametrize("front_end", ["fabric", "trainer"])
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), ("64", TypeError)])
def test_a_bad_token_budget_names_micro_batch_tokens(front_end, value, error):
    from lightning_accum import AutoMicroBatching

    sequences = PaddedSequences(mask="mask", sequence_dim=1)
    with pytest.raises(error, match=rf"`micro_batch_tokens` must be an int >= 1 or \"auto\", got {value!r}"):
        if front_end == "trainer":
            AutoMicroBatching(sequences=sequences, micro_batch_tokens=value)
        else:
            fabric, model, optimizer, _ = setup()
            FabricMicroBatching(fabric, model, optimizer, sequences=sequences, micro_batch_tokens=value)
