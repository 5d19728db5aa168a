"""The coupled-losses benchmark whose figures docs/concepts.md and docs/troubleshooting.md quote (issue 18, item 11)."""

from __future__ import annotations

import pytest

from examples.benchmarks.coupled_losses import relative_distances


@pytest.mark.parametrize("micro_batch_size", [16, 6])
def test_in_batch_negatives_are_not_exact_under_micro_batching_and_a_gradient_cache_is(micro_batch_size):
    info_nce, gradient_cache, per_pair = relative_distances(micro_batch_size, seed=0)
    assert info_nce > 0.1  # each query sees b - 1 negatives instead of 31: documented 25% at 16, 50% at 6
    assert gradient_cache < 1e-6 and per_pair < 1e-6  # float rounding: exact
