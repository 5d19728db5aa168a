import pytest
import torch

from lightning_accum.normalization import WindowNormalizer, batch_size_of, count_items


def accumulate(normalizer, chunks, reduction, world_size=1, sum_across_ranks=None):
    w = torch.zeros(1, requires_grad=True)
    normalizer.start_window(accumulation_steps=len(chunks))
    for chunk in chunks:
        loss = (w * chunk).sum() if reduction == "sum" else (w * chunk).mean()
        (loss * normalizer.add_micro_batch(len(chunk), len(chunk))).backward()
    totals = normalizer.finish_window([w], sum_across_ranks, world_size)
    return w.grad, totals


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_uneven_chunks_give_the_mean_over_all_items(reduction):
    x = torch.arange(1.0, 8.0)
    grad, totals = accumulate(WindowNormalizer(reduction), [x[:4], x[4:6], x[6:]], reduction)
    torch.testing.assert_close(grad, x.mean().reshape(1))
    assert (totals.items, totals.samples, totals.micro_batches) == (7.0, 7, 3)


def test_reference_scale_follows_the_previous_window_and_leaves_results_exact():
    normalizer = WindowNormalizer("mean")
    x = torch.arange(1.0, 13.0)
    accumulate(normalizer, [x[:6], x[6:]], "mean")
    assert normalizer.scale == 6.0  # 12 items in 2 micro-batches
    grad, _ = accumulate(normalizer, [x[:2], x[2:3]], "mean")
    torch.testing.assert_close(grad, x[:3].mean().reshape(1))


def test_world_size_undoes_ddps_mean():
    # Simulate 2 ranks whose summed counts are 3 + 5 = 8 items; DDP would average the two ranks' buffers.
    x = torch.arange(1.0, 9.0)
    ranks = [x[:3], x[3:]]
    buffers = []
    for chunk in ranks:
        w = torch.zeros(1, requires_grad=True)
        n = WindowNormalizer("mean")
        n.start_window(1)
        ((w * chunk).mean() * n.add_micro_batch(len(chunk), len(chunk))).backward()
        buffers.append((n, w))
    averaged = (buffers[0][1].grad + buffers[1][1].grad) / 2
    w = buffers[0][1]
    w.grad = averaged.clone()
    counts = [
        torch.tensor([3.0, 3.0, 1.0, 0.0], dtype=torch.float64),
        torch.tensor([5.0, 5.0, 1.0, 0.0], dtype=torch.float64),
    ]
    buffers[0][0].finish_window([w], lambda t: counts[0] + counts[1], world_size=2)
    torch.testing.assert_close(w.grad, x.mean().reshape(1))


def test_empty_window_sets_gradients_to_none():
    w = torch.zeros(1, requires_grad=True)
    n = WindowNormalizer("sum")
    n.start_window(1)
    ((w * torch.ones(3)).sum() * 0 * n.add_micro_batch(0, 3)).backward()
    totals = n.finish_window([w])
    assert w.grad is None and totals.factor == 0.0


def test_count_items_keeps_tensor_counts_on_device_and_checks_types():
    batch = {"labels": torch.tensor([[1, -100], [2, 3]])}
    count = count_items(batch, lambda b: (b["labels"] != -100).sum())
    assert isinstance(count, torch.Tensor) and int(count) == 3
    assert count_items(batch, None) == 2
    with pytest.raises(TypeError, match="got True of type bool"):
        count_items(batch, lambda b: True)


def test_batch_size_of_explains_what_to_do_when_it_cannot_tell():
    with pytest.raises(TypeError, match="Pass `count_items=`"):
        batch_size_of(object())
    assert batch_size_of(["a", "b", "c"]) == 3
