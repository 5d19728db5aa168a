import pytest
import torch

from lightning_accum.core.normalization import WindowNormalizer, batch_size_of, count_items


def accumulate(normalizer, micro_batches, reduction, world_size=1, sum_across_ranks=None):
    w = torch.zeros(1, requires_grad=True)
    normalizer.start_window(accumulation_steps=len(micro_batches))
    for micro_batch in micro_batches:
        loss = (w * micro_batch).sum() if reduction == "sum" else (w * micro_batch).mean()
        (loss * normalizer.add_micro_batch(len(micro_batch), len(micro_batch))).backward()
    totals = normalizer.finish_window([w], sum_across_ranks, world_size)
    return w.grad, totals


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_uneven_micro_batches_give_the_mean_over_all_items(reduction):
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
    for micro_batch in ranks:
        w = torch.zeros(1, requires_grad=True)
        n = WindowNormalizer("mean")
        n.start_window(1)
        ((w * micro_batch).mean() * n.add_micro_batch(len(micro_batch), len(micro_batch))).backward()
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
    # `count_items` counts what the loss averages over; it can't tell the number of samples, so it is not the fix.
    with pytest.raises(TypeError, match=r"type object.*`batch_size` attribute.*`__len__`.*`batch_size_of=`") as info:
        batch_size_of(object())
    assert "count_items" not in str(info.value)
    assert batch_size_of(["a", "b", "c"]) == 3


# ---- batch_size_of: tensors with a batch dimension ------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        {"temperature": torch.tensor(0.5), "x": torch.zeros(10, 3), "y": torch.zeros(10)},
        (torch.tensor(3), torch.zeros(10, 3)),
        [{"scale": torch.tensor(2.0)}, {"x": torch.zeros(10, 2)}],
        {"meta": {"step": torch.tensor(7)}, "inputs": [torch.zeros(10, 4), torch.zeros(10)]},
    ],
    ids=["dict", "tuple", "nested-list", "nested-dict"],
)
def test_batch_size_of_ignores_0_dim_tensors(batch):
    assert batch_size_of(batch) == 10


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            {"x": torch.zeros(10, 3), "y": torch.zeros(8)},
            r"`batch\['y'\]` has shape \(8,\), but its first dimension must be the batch size 10.*`batch\['x'\]`.*"
            r"\(10, 3\)",
        ),
        (
            (torch.zeros(4, 2), torch.zeros(4), torch.zeros(6, 2)),
            r"`batch\[2\]` has shape \(6, 2\), but its first dimension must be the batch size 4.*`batch\[0\]`",
        ),
        (
            {"images": torch.zeros(5, 3, 2, 2), "targets": [{"boxes": torch.zeros(i + 1, 4)} for i in range(4)]},
            r"`batch\['targets'\]` is a list of 4 entries, but .* batch size 5.*`batch\['images'\]`",
        ),
    ],
    ids=["dict", "tuple", "per-sample-list"],
)
def test_batch_size_of_refuses_tensors_that_disagree_and_names_them(batch, match):
    with pytest.raises(ValueError, match=match):
        batch_size_of(batch)


def test_batch_size_of_error_on_disagreement_says_how_to_fix():
    with pytest.raises(ValueError, match=r"Put the samples on dim 0.*0-dim tensor.*`batch_size_of=`"):
        batch_size_of({"x": torch.zeros(10, 3), "y": torch.zeros(8)})


def test_batch_size_of_refuses_a_batch_with_no_batch_dimension():
    with pytest.raises(TypeError, match=r"no tensor with a batch dimension"):
        batch_size_of({"step": torch.tensor(3), "lr": 0.1})


# ---- batch_size_of: custom batch objects ----------------------------------------------------------------------------


class _WithBatchSize:
    def __init__(self, n):
        self.x = torch.zeros(n, 2)
        self.batch_size = n


class _WithLen:
    def __init__(self, n):
        self.x = torch.zeros(n, 2)

    def __len__(self):
        return len(self.x)


class _WithSize:
    """tensordict's TensorDict reports its batch size as a torch.Size."""

    def __init__(self, n):
        self.batch_size = torch.Size([n, 7])


def test_batch_size_of_reads_the_batch_objects_own_count():
    assert batch_size_of(_WithBatchSize(6)) == 6
    assert batch_size_of(_WithLen(5)) == 5
    assert batch_size_of(_WithSize(4)) == 4


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (2.5, TypeError, r"`_WithBatchSize.batch_size` must be an int >= 0, got 2.5 of type float\. It is the number"),
        (-1, ValueError, r"`_WithBatchSize.batch_size` must be an int >= 0, got -1\. It is the number of samples"),
        ("8", TypeError, r"`_WithBatchSize.batch_size` must be an int >= 0, got '8' of type str"),
    ],
)
def test_a_bad_batch_size_attribute_is_named(value, error, match):
    batch = _WithBatchSize(3)
    batch.batch_size = value
    with pytest.raises(error, match=match):
        batch_size_of(batch)


# ---- count_items: what a counter may return -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (torch.tensor([1.0, 0.0, 1.0, 1.0]).sum(), 3.0),  # Megatron's float loss mask
        (torch.tensor([0.5, 1.25]).sum(), 1.75),  # sample weights
        (torch.tensor(2.5, dtype=torch.float64), 2.5),
        (torch.tensor(3, dtype=torch.int32), 3),
        (torch.tensor([4]), 4),  # a single-element tensor of any shape
        (2.5, 2.5),
        (0.0, 0.0),
    ],
)
def test_count_items_accepts_non_negative_float_and_integer_counts(returned, expected):
    count = count_items({}, lambda b: returned)
    assert float(count) == expected
    if isinstance(count, torch.Tensor):
        assert count.shape == ()


def test_count_items_keeps_half_precision_counts_exact():
    # A bf16 sum rounds at 256; the counts are upcast so that the window total is summed in float32 or better.
    count = count_items({}, lambda b: torch.tensor(3.0, dtype=torch.bfloat16))
    assert count.dtype == torch.float32 and float(count) == 3.0


def test_count_items_accepts_numpy_numbers():
    np = pytest.importorskip("numpy")
    mask = np.array([[1, 0, 1], [1, 1, 0]])
    assert count_items({}, lambda b: mask.sum()) == 4 and type(count_items({}, lambda b: mask.sum())) is int
    weighted = count_items({}, lambda b: (mask * np.float32(0.5)).sum())
    assert weighted == 2.0 and type(weighted) is float
    assert count_items({}, lambda b: np.array([7])) == 7


@pytest.mark.parametrize(
    ("returned", "error", "match"),
    [
        (torch.tensor([1, 2]), TypeError, r"`count_items` must return a single number, got a tensor of shape \(2,\)"),
        (torch.tensor(True), TypeError, r"`count_items` returned a tensor of dtype torch.bool.*\.sum\(\)"),
        (torch.tensor(1 + 2j), TypeError, r"`count_items` returned a tensor of dtype torch.complex"),
        (torch.tensor(float("nan")), ValueError, r"`count_items` returned nan for a micro-batch.*finite"),
        (float("inf"), ValueError, r"`count_items` returned inf for a micro-batch.*finite"),
        (-0.5, ValueError, r"`count_items` returned a negative count.*got -0.5"),
        (torch.tensor(-2.0), ValueError, r"`count_items` returned a negative count.*got -2.0"),
        (-1, ValueError, r"`count_items` returned a negative count.*non-negative count, got -1"),
        ("3", TypeError, r"`count_items` must return .* got '3' of type str"),
        (None, TypeError, r"`count_items` must return .* got None of type NoneType"),
    ],
)
def test_count_items_refuses_what_is_not_a_count(returned, error, match):
    with pytest.raises(error, match=match):
        count_items({}, lambda b: returned)


def test_count_items_refuses_numpy_booleans_and_arrays():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"`count_items` must return a single number, got an array of shape \(2,\)"):
        count_items({}, lambda b: np.array([1, 2]))
    with pytest.raises(TypeError, match=r"dtype bool"):
        count_items({}, lambda b: np.bool_(True))
    with pytest.raises(ValueError, match=r"returned a negative count.*got -3"):
        count_items({}, lambda b: np.int64(-3))


# ---- WindowNormalizer: float counts ---------------------------------------------------------------------------------


def test_float_counts_give_the_weighted_mean():
    # Micro-batch losses are weighted means sum(w*l)/sum(w); the window gradient must be that over all weights.
    w = torch.zeros(1, requires_grad=True)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    weights = torch.tensor([0.5, 1.5, 0.25, 2.0, 1.0])
    normalizer = WindowNormalizer("mean")
    normalizer.start_window(2)
    for sl in (slice(0, 3), slice(3, 5)):
        loss = (w * values[sl] * weights[sl]).sum() / weights[sl].sum()
        (loss * normalizer.add_micro_batch(weights[sl].sum(), 2)).backward()
    totals = normalizer.finish_window([w])
    torch.testing.assert_close(w.grad, ((values * weights).sum() / weights.sum()).reshape(1))
    assert totals.items == pytest.approx(5.25)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_non_finite_or_negative_device_count_is_refused_at_the_step(bad):
    # Counts on an accelerator are only read at the step (no sync per micro-batch): the check happens there.
    w = torch.zeros(1, requires_grad=True)
    normalizer = WindowNormalizer("mean")
    normalizer.start_window(2)
    for count in (torch.tensor(2.0), torch.tensor(bad)):
        ((w * 1.0).sum() * normalizer.add_micro_batch(count, 1)).backward()
    with pytest.raises(ValueError, match=r"`count_items` returned a negative count, NaN or inf"):
        normalizer.finish_window([w])
