"""`BalancedBatchSampler` misconfigured as a user does by mistake: refused at once, naming the argument and the fix.

Issue 35 (items 9 to 11): lengths that do not count the dataset's samples, lengths of shape (N, 1), and ranks that
would take one share twice. The checks of every rank's gathered settings are pure (`ranks_deal_apart`); the same on 2
real ranks is in tests/test_sampler_slips_ranks.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader, Subset

import tests.helpers as h
from lightning_accum.callbacks import BalancedSamplerState
from lightning_accum.sequences import BalancedBatchSampler
from lightning_accum.sequences.balanced_sampler import check_lengths_match, ranks_deal_apart
from lightning_accum.sequences.loaders import check_loader_lengths

LENGTHS = [5, 1, 7, 3, 2, 8]


# ---- 9: one length per sample of the dataset -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lengths", "samples", "words"),
    [
        (20, 24, "samples 20 to 23 would never be trained"),
        (24, 20, "indices 20 to 23 are past the dataset's end (an IndexError in its `__getitem__`)"),
    ],
    ids=["shorter", "longer"],
)
def test_lengths_that_do_not_count_the_datasets_samples_are_refused_naming_both_counts(lengths, samples, words):
    expected = f"`BalancedBatchSampler` has {lengths} `lengths` but its dataset has {samples} samples: {words}."
    with pytest.raises(ValueError, match=re.escape(expected) + ".*`lengths=<function of a sample>` with `dataset=`"):
        BalancedBatchSampler([3] * lengths, 4, dataset=list(range(samples)))
    sampler = BalancedBatchSampler([3] * lengths, 4)  # no dataset given: the loader's is checked where it is known
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_lengths_match(sampler, list(range(samples)))
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_loader_lengths({"train": DataLoader(list(range(samples)), batch_sampler=sampler)})


def test_the_lengths_of_a_set_before_its_subset_are_refused_with_the_subsets_own_as_the_fix():
    whole = list(range(24))
    subset = Subset(whole, range(0, 24, 2))
    with pytest.raises(ValueError, match=r"\[lengths\[i\] for i in subset.indices\]"):
        BalancedBatchSampler(list(range(1, 25)), 4, dataset=subset)
    lengths = list(range(1, 25))
    sampler = BalancedBatchSampler([lengths[i] for i in subset.indices], 4, dataset=subset)
    assert sorted(i for batch in sampler for i in batch) == list(range(12))


def test_lengths_that_match_and_datasets_of_no_length_pass():
    check_lengths_match(BalancedBatchSampler(LENGTHS, 2), list(range(6)))
    check_lengths_match(BalancedBatchSampler(LENGTHS, 2), iter(range(99)))  # an iterable: nothing to count
    check_loader_lengths([DataLoader(list(range(3)), batch_size=2)])  # no BalancedBatchSampler: nothing to check
    BalancedBatchSampler(lambda n: n, 2, dataset=LENGTHS)  # read from the dataset: one each by construction


def test_balanced_sampler_state_refuses_a_train_loader_whose_lengths_miss_samples(tmp_path):
    data = h.IndexedDataset(12)
    loader = DataLoader(data, batch_sampler=BalancedBatchSampler([4] * 10, 4))
    trainer = h.make_trainer(tmp_path, [BalancedSamplerState()], max_steps=1)
    with pytest.raises(ValueError, match=r"has 10 `lengths` but its dataset has 12 samples: samples 10 to 11"):
        trainer.fit(h.RegressionModel(), loader)


# ---- 10: lengths are 1-D ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lengths", "shown"),
    [
        (torch.tensor(LENGTHS)[:, None], r"got shape \(6, 1\)\. For a \(N, 1\) tensor pass `lengths.squeeze\(1\)`"),
        ((torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]).sum(1, keepdim=True), r"got shape \(6, 1\)"),
        (torch.tensor(5), r"got shape \(\)"),
        ([[n] for n in LENGTHS], r"got a sequence holding \[5\]\. Flatten it"),
    ],
    ids=["(N, 1) tensor", "mask.sum(1, keepdim=True)", "0-d tensor", "list of lists"],
)
def test_lengths_that_are_not_1d_are_refused_saying_so_with_the_fix(lengths, shown):
    with pytest.raises(ValueError, match=r"`lengths` must be 1-D \(one .* a sample\), " + shown + ".*`mask.sum\\(1"):
        BalancedBatchSampler(lengths, 2)


def test_1d_lengths_as_a_tensor_or_a_mask_sum_are_taken():
    mask = torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]
    assert BalancedBatchSampler(mask.sum(1), 2).lengths == LENGTHS
    assert BalancedBatchSampler(torch.tensor(LENGTHS)[:, None].squeeze(1), 2).lengths == LENGTHS


# ---- 11: every rank takes its own share once -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_replicas", "rank", "error", "words"),
    [
        (0, None, ValueError, "`num_replicas` must be an int >= 1, got 0. Leave `num_replicas` and `rank` unset"),
        (-2, None, ValueError, "`num_replicas` must be an int >= 1, got -2."),
        (2.0, None, TypeError, "`num_replicas` must be an int >= 1, got 2.0 of type float."),
        (2, -1, ValueError, "`rank` must be an int >= 0, got -1."),
    ],
)
def test_a_num_replicas_or_rank_that_is_no_count_is_refused_at_construction(num_replicas, rank, error, words):
    with pytest.raises(error, match=re.escape(words)):
        BalancedBatchSampler(LENGTHS, 2, num_replicas=num_replicas, rank=rank)


def _settings(num_replicas: int, rank: int) -> dict:
    return BalancedBatchSampler(LENGTHS, 4, num_replicas=num_replicas, rank=rank).deal_settings()


def test_the_settings_hold_the_rank_and_world_size_the_sampler_deals_by():
    settings = _settings(2, 1)
    assert (settings["num_replicas"], settings["rank"]) == (2, 1)
    assert ranks_deal_apart([[_settings(2, 0)], [_settings(2, 1)]]) is None  # the rank differs, as it must


def test_two_ranks_of_one_rank_are_named_with_the_share_never_trained():
    message = ranks_deal_apart([[_settings(3, 0)], [_settings(3, 0)], [_settings(3, 2)]])
    assert message is not None
    assert message.startswith(
        "`BalancedBatchSampler(rank=0)` on ranks 0, 1: they would train the same share of each step, and the share"
        " of rank 1 never. Leave `rank` unset"
    )
    assert "`trainer.global_rank`, `fabric.global_rank` or `torch.distributed.get_rank()`" in message


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_a_num_replicas_that_is_not_the_world_size_is_named(num_replicas):
    every = [[_settings(num_replicas, 0)], [_settings(num_replicas, min(1, num_replicas - 1))]]
    message = ranks_deal_apart(every)
    assert message is not None and message.startswith(
        f"`BalancedBatchSampler(num_replicas={num_replicas})` on rank 0, but 2 ranks train: each step would be dealt"
        f" in {num_replicas} shares"
    )
    assert message.endswith("or pass the world size, 2.")


def test_settings_gathered_from_an_older_peer_without_ranks_still_compare():
    old = {"seed": 0, "batch_size": 4}
    assert ranks_deal_apart([[old], [dict(old)]]) is None
    assert "`seed` is 0 on rank 0 and 1 on rank 1" in str(ranks_deal_apart([[old], [dict(old, seed=1)]]))
