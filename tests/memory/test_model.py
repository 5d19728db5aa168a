import math

import pytest

from lightning_accum.memory.model import LinearPeakModel


def test_exact_line_is_recovered():
    model = LinearPeakModel()
    for b in (1, 2, 4, 8):
        model.observe(b, 1_000 + 250 * b)
    assert model.fitted()
    assert model.fixed_bytes == pytest.approx(1_000)
    assert model.per_sample_bytes == pytest.approx(250)
    assert model.predict(16) == pytest.approx(1_000 + 250 * 16)


def test_least_squares_over_noisy_points():
    model = LinearPeakModel()
    model.observe(1, 110.0)
    model.observe(2, 190.0)
    model.observe(3, 310.0)
    # closed form: slope = sum((x-2)(y-mean)) / sum((x-2)^2) = (-1*-93.33 + 1*106.67) / 2
    mean = (110 + 190 + 310) / 3
    slope = ((1 - 2) * (110 - mean) + (3 - 2) * (310 - mean)) / 2
    assert model.per_sample_bytes == pytest.approx(slope)
    assert model.fixed_bytes == pytest.approx(mean - slope * 2)


def test_unfitted_until_two_distinct_sizes():
    model = LinearPeakModel()
    model.observe(4, 100.0)
    model.observe(4, 120.0)
    assert not model.fitted()
    assert model.fixed_bytes is None and model.per_sample_bytes is None
    with pytest.raises(RuntimeError, match=r"only 1 distinct micro-batch size\(s\) were observed \(\[4\]\)"):
        model.predict(2)


def test_latest_peak_per_size_replaces_the_old_one():
    model = LinearPeakModel()
    model.observe(1, 100.0)
    model.observe(2, 200.0)
    model.observe(2, 300.0)  # e.g. a longer sequence length now
    assert model.observations == {1: 100.0, 2: 300.0}
    assert model.per_sample_bytes == pytest.approx(200.0)


def test_history_is_bounded_and_drops_the_least_recent_size():
    model = LinearPeakModel(max_sizes=3)
    for b in (1, 2, 3, 4):
        model.observe(b, 10.0 * b)
    assert sorted(model.observations) == [2, 3, 4]
    model.observe(2, 20.0)  # refreshing size 2 makes 3 the oldest
    model.observe(5, 50.0)
    assert sorted(model.observations) == [2, 4, 5]


def test_negative_slope_is_clamped_to_zero():
    model = LinearPeakModel()
    model.observe(1, 500.0)
    model.observe(8, 400.0)
    assert model.per_sample_bytes == 0.0
    assert model.fixed_bytes == pytest.approx(450.0)  # flat least squares: the mean
    assert model.largest_fitting(460.0, upper=64) == 64
    assert model.largest_fitting(449.0, upper=64) is None


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (1_000 + 100 * 1, 1),
        (1_000 + 100 * 7 + 99, 7),
        (1_000 + 100 * 7, 7),
        (1_000 + 100 * 500, 32),  # capped at `upper`
        (1_000 + 100 * 1 - 1, None),
    ],
)
def test_largest_fitting(budget, expected):
    model = LinearPeakModel()
    model.observe(2, 1_000 + 100 * 2)
    model.observe(6, 1_000 + 100 * 6)
    got = model.largest_fitting(budget, upper=32)
    assert got == expected
    if got is not None:
        assert model.predict(got) <= budget
        assert got == 32 or model.predict(got + 1) > budget


def test_largest_fitting_is_exact_at_float_boundaries():
    model = LinearPeakModel()
    model.observe(1, 0.1 + 0.7)
    model.observe(3, 0.1 + 3 * 0.7)
    for budget in (0.1 + 0.7 * b for b in range(1, 50)):
        b = model.largest_fitting(budget, upper=1000)
        assert b is not None and model.predict(b) <= budget and model.predict(b + 1) > budget


def test_relative_error():
    model = LinearPeakModel()
    model.observe(1, 100.0)
    model.observe(2, 200.0)
    assert model.relative_error([(3, 300.0)]) == 0.0
    assert model.relative_error({3: 250.0, 4: 500.0}) == pytest.approx((50 / 250 + 100 / 500) / 2)
    with pytest.raises(ValueError, match="at least one"):
        model.relative_error([])
    with pytest.raises(ValueError, match="peak of 0 bytes for micro-batch size 3"):
        model.relative_error([(3, 0.0)])


def test_state_dict_round_trip_keeps_recency_order():
    model = LinearPeakModel(max_sizes=3)
    for b, peak in ((4, 40.0), (1, 12.0), (2, 21.0)):
        model.observe(b, peak)
    restored = LinearPeakModel()
    restored.load_state_dict(model.state_dict())
    assert restored.max_sizes == 3
    assert restored.observations == model.observations
    assert restored.predict(7) == pytest.approx(model.predict(7))
    restored.observe(8, 80.0)  # the oldest size (4) must go first, as in the original
    assert sorted(restored.observations) == [1, 2, 8]


def test_load_state_dict_accepts_an_empty_state():
    model = LinearPeakModel()
    model.observe(1, 1.0)
    model.load_state_dict({})
    assert model.observations == {} and not model.fitted()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: m.observe(0, 1.0), ValueError, r"`micro_batch_size` must be an int >= 1, got 0"),
        (lambda m: m.observe(True, 1.0), TypeError, r"`micro_batch_size` must be an int >= 1, got True of type bool"),
        (lambda m: m.observe(2, -5.0), ValueError, r"`peak_bytes` must be a finite number of bytes >= 0, got -5.0"),
        (lambda m: m.observe(2, math.nan), ValueError, r"`peak_bytes` must be a finite number"),
        (lambda m: m.observe(2, "1GB"), TypeError, r"`peak_bytes` must be a finite number of bytes >= 0, got '1GB'"),
    ],
)
def test_bad_observations_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(LinearPeakModel())


def test_max_sizes_must_allow_a_line():
    with pytest.raises(ValueError, match=r"`max_sizes` must be an int >= 2, got 1\. A line needs two sizes"):
        LinearPeakModel(max_sizes=1)
