"""Split mode by tokens on one process: sorted by length, cut by a token budget, trimmed, and exact (issue 21)."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AutoMicroBatching
from lightning_accum.batches import SequenceTrim
from lightning_accum.items import CountTokens
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.sequences import PaddedSequences, token_cut
from lightning_accum.sequences.token_cut import MICRO_BATCH_COST, TokenCut
from lightning_accum.split.planner.messages import MicroBatchOOMError
from tests.token_models import TinyCausalLM, TokenSequences, full_batch_reference, lognormal_lengths, pad_right

LR = 0.1


# ---- the cut -------------------------------------------------------------------------------------------------------


def test_a_step_batch_is_ordered_longest_first_cut_within_the_budget_and_trimmed():
    dataset = TokenSequences([3, 9, 4, 4, 1, 6])
    batch = pad_right([dataset[i] for i in range(6)])
    cut = PaddedSequences(mask="attention_mask").cut(batch)
    assert cut.order == [1, 5, 2, 3, 0, 4] and cut.lengths == [9, 6, 4, 4, 3, 1]  # a stable sort, longest first
    # At 12 a micro-batch costs 12 // 32 = 0 tokens more: 9 alone (2 x 9 > 12), and only equal lengths share one.
    assert [m.batch["index"].tolist() for m in cut.split(batch, 12)] == [[1], [5], [2, 3], [0], [4]]
    stats = cut.stats(12)
    assert (stats.padded, stats.real, stats.largest, stats.micro_batches) == (27, 27, 9, 5)
    # At 128 one costs 4 more: 9 + 6 share one (3 padded < 4), and 4, 4, 3, 1 another (4 padded < 1 + 4).
    micro_batches = cut.split(batch, 128)
    assert [m.batch["index"].tolist() for m in micro_batches] == [[1, 5], [2, 3, 0, 4]]
    assert [tuple(m.batch["input_ids"].shape) for m in micro_batches] == [(2, 9), (4, 4)]
    for micro in micro_batches:
        for row, index in enumerate(micro.batch["index"].tolist()):
            n = len(dataset[index]["input_ids"])
            torch.testing.assert_close(micro.batch["input_ids"][row, :n], dataset[index]["input_ids"])
    stats = cut.stats(128)
    assert (stats.padded, stats.real, stats.largest, stats.micro_batches) == (2 * 9 + 4 * 4, 27, 18, 2)


def cheapest_cut(lengths: list[int], budget: int) -> list[list[int]]:
    """By brute force over every cut into consecutive micro-batches (lengths longest first): the one `TokenCut.groups`
    must give. Each micro-batch within the budget (or one sequence alone), costing its padded tokens plus
    ``budget // MICRO_BATCH_COST``; of equal costs, the one with fewer micro-batches."""
    n, overhead, best = len(lengths), budget // MICRO_BATCH_COST, None
    for mask in range(2 ** (n - 1)):
        stops = [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        groups, start = [], 0
        for stop in stops:
            groups.append(lengths[start:stop])
            start = stop
        if any(len(g) > 1 and len(g) * g[0] > budget for g in groups):
            continue
        key = (sum(overhead + len(g) * g[0] for g in groups), len(groups))
        if best is None or key < best[0]:
            best = (key, groups)
    assert best is not None
    return best[1]


@pytest.mark.parametrize("seed", range(40))
def test_the_cut_is_the_cheapest_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 11, (1,), generator=g))
    lengths = sorted(lognormal_lengths(n, seed=seed, median=20, cap=200), reverse=True)
    budget = int(torch.randint(8, 1200, (1,), generator=g))
    cut = TokenCut(None, list(range(n)), lengths, max(lengths), 1)
    groups = [lengths[r.start : r.stop] for r in cut.groups(budget)]
    assert groups == cheapest_cut(lengths, budget), (lengths, budget)
    assert [i for r in cut.groups(budget) for i in r] == list(range(n))  # every sample once, in order
    stats = cut.stats(budget)
    assert stats.micro_batches == len(groups) and stats.padded == sum(len(m) * m[0] for m in groups)
    assert stats.largest <= max(budget, lengths[0])
    # Never more padded tokens than filling each micro-batch to the budget, counting what a micro-batch costs.
    greedy, start = [], 0
    while start < n:
        count = max(1, budget // lengths[start])
        greedy.append(lengths[start : start + count])
        start += count
    cost = budget // MICRO_BATCH_COST
    assert sum(cost + len(m) * m[0] for m in groups) <= sum(cost + len(m) * m[0] for m in greedy)


@pytest.mark.parametrize("seed", range(6))
def test_the_long_windows_vectorized_minimum_cuts_as_the_short_windows_loop(monkeypatch, seed):
    lengths = sorted(lognormal_lengths(300, seed=seed, median=6, cap=120), reverse=True)
    cuts = {}
    for short_window in (0, 10**9):  # every window vectorized, then none
        monkeypatch.setattr(token_cut, "_SHORT_WINDOW", short_window)
        cut = TokenCut(None, list(range(300)), lengths, lengths[0], 1)
        cuts[short_window] = [[(r.start, r.stop) for r in cut.groups(budget)] for budget in (7, 64, 500, 2000, 9000)]
    assert cuts[0] == cuts[10**9]
    assert len({len(groups) for groups in cuts[0]}) > 2  # the budgets cut differently


def test_a_step_makes_one_index_tensor_per_device_not_one_per_micro_batch(monkeypatch):
    # Each micro-batch took its rows with an index tensor of its own: on CUDA a host-to-device copy per micro-batch,
    # which waits for the work queued before it. The step's sorted order is made into one, which each slices.
    # At 64 tokens, micro-batches of samples [1, 7], [3, 9], [5, 4], [0, 8, 2, 6]: none consecutive in the batch.
    dataset = TokenSequences([2, 9, 1, 6, 3, 4, 1, 7, 2, 5])
    batch = pad_right([dataset[i] for i in range(10)])
    cut = PaddedSequences(mask="attention_mask").cut(batch)
    made = []
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        made.append(data)
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    micro_batches = cut.split(batch, 64)
    monkeypatch.setattr(torch, "tensor", real_tensor)
    assert [[cut.order[i] for i in g] for g in cut.groups(64)] == [[1, 7], [3, 9], [5, 4], [0, 8, 2, 6]]
    assert made == [cut.order]  # was one per micro-batch: 4
    plan = PaddedSequences(mask="attention_mask").cut(batch).plan
    for micro, group in zip(micro_batches, cut.groups(64), strict=True):  # the rows `take` gives for those indices
        longest = cut.lengths[group.start]
        expected = plan.take([cut.order[i] for i in group], trim=SequenceTrim(1, cut.padded_length, longest))
        assert micro.batch.keys() == expected.keys() and micro.size == len(group)
        for key in expected:
            torch.testing.assert_close(micro.batch[key], expected[key], rtol=0, atol=0)


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    cut = TokenCut(None, [0, 1, 2], [20, 18, 2], 20, 1)
    assert [list(g) for g in cut.groups(8)] == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        ([[0, 1, 1], [1, 1, 0]], r"sample 0 of the step batch is left-padded.*padding_side = 'right'"),
        ([[1, 1, 0], [0, 0, 1]], r"sample 1 of the step batch is left-padded"),
    ],
)
def test_left_padding_is_refused_with_a_clear_error(mask, match):
    with pytest.raises(ValueError, match=match):
        PaddedSequences(mask="attention_mask").lengths({"attention_mask": torch.tensor(mask)})


def test_equal_settings_are_equal_and_two_functions_are_not():
    # Equality went by the repr, where every lambda reads `<lambda>`: two different length functions were equal.
    first, second = PaddedSequences(lengths=lambda b: b["n"]), PaddedSequences(lengths=lambda b: b["m"])
    assert first != second and first == first
    assert PaddedSequences(lengths="math:floor") == PaddedSequences(lengths=math.floor)  # a path, and what it names
    assert PaddedSequences(mask="attention_mask") == PaddedSequences(mask="attention_mask", sequence_dim=1)
    assert PaddedSequences(mask="attention_mask") != PaddedSequences(mask="attention_mask", sequence_dim=2)
    assert len({PaddedSequences(), PaddedSequences(), first, second}) == 3


def test_lengths_from_a_function_and_the_padded_length_from_the_batch():
    batch = {"ids": torch.zeros(3, 10), "scores": torch.zeros(3, 2), "n": torch.tensor([4, 7, 2])}
    cut = PaddedSequences(lengths=lambda b: b["n"]).cut(batch)
    assert cut.padded_length == 10 and cut.lengths == [7, 4, 2]
    # At 128 a micro-batch costs 4 tokens more: 4 and 2 share one (2 padded), 7 runs alone (with them: 8 padded).
    assert [tuple(m.batch["ids"].shape) for m in cut.split(batch, 128)] == [(1, 7), (2, 4)]
    assert [tuple(m.batch["scores"].shape) for m in cut.split(batch, 128)] == [(1, 2), (2, 2)]  # not a sequence field


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mask": "attention_mask", "lengths": len}, ValueError, r"takes `mask` or `lengths`, not both"),
        ({"mask": 1.5}, TypeError, r"`mask` must be a str .* got 1.5"),
        ({"lengths": 3}, TypeError, r"`lengths` must be a function of the batch"),
        ({"sequence_dim": 0}, ValueError, r"`sequence_dim` must be an int >= 1, got 0"),
    ],
)
def test_bad_sequences_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PaddedSequences(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_tokens": 64}, r"`micro_batch_tokens=64` needs `sequences=`"),
        ({"sequences": PaddedSequences(), "micro_batch_size": 8}, r"`micro_batch_size=8` does not apply with"),
        ({"sequences": PaddedSequences(), "split_batch": len}, r"`split_batch` does not apply with `sequences=`"),
        # It was taken and did nothing (the floor is the longest sequence), or refused naming `micro_batch_size`.
        (
            {"sequences": PaddedSequences(), "micro_batch_tokens": 32, "min_micro_batch_size": 64},
            r"`min_micro_batch_size=64` does not apply with `sequences=`: .* longest sequence alone",
        ),
        ({"sequences": PaddedSequences(), "min_micro_batch_size": 2}, r"`min_micro_batch_size=2` does not apply"),
    ],
)
def test_token_arguments_that_do_not_go_together_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoMicroBatching(**kwargs)


# ---- exact, on one process -----------------------------------------------------------------------------------------


def fit_tokens(tmp_path, callback, lengths, step_batch=16, steps=None, pad_to=None, **trainer_kwargs):
    dataset = TokenSequences(lengths, seed=1)
    model = TinyCausalLM(lr=LR)
    initial = copy.deepcopy(model)
    collate = functools.partial(pad_right, pad_to=pad_to)
    trainer = h.make_trainer(tmp_path, [callback], max_steps=steps or -1, **trainer_kwargs)
    trainer.fit(model, DataLoader(dataset, batch_size=step_batch, collate_fn=collate))
    expected = full_batch_reference(initial, dataset, model.step_indices, lr=LR)
    return model, expected, trainer


def token_callback(**kwargs):
    return AutoMicroBatching(sequences=PaddedSequences(), count_items=CountTokens("labels", shift=1), **kwargs)


@pytest.mark.parametrize("budget", [40, 96, 1000])
def test_token_split_is_exact_against_one_full_batch_pass(tmp_path, budget):
    lengths = lognormal_lengths(48, seed=2)
    callback = token_callback(micro_batch_tokens=budget, pin_micro_batch_size=True)
    model, expected, trainer = fit_tokens(tmp_path, callback, lengths, pad_to=56)
    assert trainer.global_step == 3
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)
    longest = max(lengths)
    # Within the budget, except a sequence longer than it, alone; trimmed to its longest (not the padded 56).
    assert all(b * n <= max(budget, longest) and (n <= budget or b == 1) for b, n in model.micro_batch_shapes)
    assert max(n for _, n in model.micro_batch_shapes) == longest < 56
    report = callback.last_step_report
    last = [lengths[i] for i in model.step_indices[-1]]
    assert report.micro_batch_tokens == min(budget, len(last) * max(last))  # the budget, as far as the step needs it
    in_one_piece = 1 - sum(last) / (len(last) * max(last))  # the padding of the step in one micro-batch, trimmed
    assert report.padding_fraction <= in_one_piece + 1e-9 and (budget > 200 or report.padding_fraction < 0.3)
    assert report.effective_batch_size == 16


def test_padding_is_what_the_cut_computes_beyond_the_real_tokens(tmp_path):
    lengths = [4, 4, 2, 2]
    callback = token_callback(micro_batch_tokens=8, pin_micro_batch_size=True)
    model, expected, _ = fit_tokens(tmp_path, callback, lengths, step_batch=4, pad_to=10)
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)
    assert model.micro_batch_shapes == [(2, 4), (2, 2)]  # trimmed: no padding left
    assert callback.last_step_report.padding_fraction == 0.0


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("micro_batch", [0, 1])
def test_an_oom_re_runs_the_step_at_a_smaller_token_budget_exactly(tmp_path, phase, micro_batch):
    lengths = lognormal_lengths(32, seed=3)
    fault = OOMFault(step=1, micro_batch=micro_batch, phase=phase, when_size_above=48)
    callback = token_callback(micro_batch_tokens=96, fault_injector=OOMInjector(fault), oom_cooldown=5)
    model, expected, _ = fit_tokens(tmp_path, callback, lengths)
    assert callback.oom_retries == 1
    assert [(e.kind, e.before) for e in callback.events if e.kind == "oom_recovered"] == [("oom_recovered", 96)]
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)


def test_an_oom_with_the_longest_sequence_alone_raises_with_the_memory_figures(tmp_path):
    lengths = [20, 3, 3, 3]
    fault = OOMFault(step=0, micro_batch=0, phase="forward", times=None)
    callback = token_callback(micro_batch_tokens=64, fault_injector=OOMInjector(fault))
    with pytest.raises(
        MicroBatchOOMError, match=r"longest sequence has 20 tokens and runs in a micro-batch of its own"
    ):
        fit_tokens(tmp_path, callback, lengths, step_batch=4)


def test_auto_starts_from_the_preflight_in_tokens(tmp_path):
    lengths = lognormal_lengths(48, seed=4)
    callback = token_callback(max_memory=0.9)
    model, expected, _ = fit_tokens(tmp_path, callback, lengths)
    assert callback.preflight_result is not None and callback.preflight_result.peak_model is not None
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)


# ---- data as it comes (issue 25): masks of every form, left padding, labels on padding, fields of odd shapes -------


def collate(samples, pad_to=None, mask_form="int", left=False, labels_on_padding=False, **extra):
    """``pad_right``'s batch with the mask in ``mask_form``, or left-padded, or with labels = input_ids."""
    batch = pad_right(samples, pad_to=pad_to)
    real = batch["attention_mask"].bool()
    if left:
        lengths = real.sum(1)
        batch = {k: v for k, v in batch.items()}
        for key in ("input_ids", "attention_mask", "labels"):
            rolled = [torch.roll(row, int(row.shape[0] - n)) for row, n in zip(batch[key], lengths, strict=True)]
            batch[key] = torch.stack(rolled)
        real = batch["attention_mask"].bool()
    if labels_on_padding:
        batch["labels"] = batch["input_ids"].clone()  # no -100 anywhere: the loss scores padding
    forms = {
        "bool": real,
        "int": real.long(),
        "float": real.float(),
        "additive": torch.zeros(real.shape).masked_fill(~real, -1e9),
        "additive_inf": torch.zeros(real.shape).masked_fill(~real, float("-inf")),
    }
    batch["attention_mask"] = forms[mask_form]
    return batch | {k: fn(batch) for k, fn in extra.items()}


class AnyMaskLM(TinyCausalLM):
    """`TinyCausalLM` that reads its mask in any form: 0/1 and bool as given, an additive one as 0 = attend."""

    def __init__(self, additive=False, **kwargs):
        super().__init__(**kwargs)
        self.additive = additive

    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids, attention_mask == 0 if self.additive else attention_mask)


def fit_form(tmp_path, callback, model, make_batch, lengths, step_batch=8):
    dataset = TokenSequences(lengths, seed=5)
    initial = copy.deepcopy(model)
    trainer = h.make_trainer(tmp_path, [callback])
    trainer.fit(model, DataLoader(dataset, batch_size=step_batch, collate_fn=make_batch))
    return full_batch_reference(initial, dataset, model.step_indices, lr=LR, collate=make_batch), initial


LENGTHS = [9, 3, 7, 2, 5, 8, 4, 6, 2, 9, 3, 5, 7, 4, 6, 8]


@pytest.mark.parametrize("form", ["bool", "int", "float", "additive", "additive_inf"])
def test_every_mask_form_is_read_and_the_split_is_exact(tmp_path, form):
    # An additive float mask (0 on real positions, -1e9 on padding) was refused as "left-padded".
    make_batch = functools.partial(collate, mask_form=form, pad_to=12)
    model = AnyMaskLM(additive=form.startswith("additive"), lr=LR)
    callback = token_callback(micro_batch_tokens=24, pin_micro_batch_size=True)
    expected, _ = fit_form(tmp_path, callback, model, make_batch, LENGTHS)
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)
    assert max(n for _, n in model.micro_batch_shapes) == 9 < 12  # trimmed
    batch = make_batch([TokenSequences([4, 2], seed=0)[i] for i in range(2)])
    assert PaddedSequences().lengths(batch).tolist() == [4, 2]


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.tensor([[1.0, 0.5, 0.0]]), r"a float mask holding values from 0 to 1, neither 0/1 nor additive"),
        (torch.tensor([[0.0, -1e9, 1.0]]), r"a float mask holding values from -1e\+09 to 1, neither 0/1 nor additive"),
        (torch.tensor([[1, -1, 0]]), r"an integer mask holding -1 \(below 0\)"),
        (torch.tensor([[1.0, float("nan")]]), r"a mask holding NaN"),
    ],
)
def test_a_mask_of_another_form_is_refused_for_what_it_is(mask, match):
    with pytest.raises(ValueError, match=match + r".*It reads a bool mask .* or an additive float mask"):
        PaddedSequences(mask="attention_mask").lengths({"attention_mask": mask})


def left_padded_lengths(batch):
    return batch["attention_mask"].bool().sum(1)


def test_lengths_on_left_padded_data_with_a_mask_is_refused_before_any_update(tmp_path):
    # `lengths=` trimmed the real tokens off left-padded data, silently: the update was off the full-batch one.
    make_batch = functools.partial(collate, left=True, pad_to=12)
    model = TinyCausalLM(lr=LR)
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(
        sequences=PaddedSequences(lengths=left_padded_lengths),
        micro_batch_tokens=24,
        pin_micro_batch_size=True,
        count_items=CountTokens("labels", shift=1),
    )
    with pytest.raises(
        ValueError,
        match=r"sample 0 of the step batch has length 9 by `lengths=`, but `batch\['attention_mask'\]` marks a real"
        r" token at position 9: trimming .* reads right padding",
    ):
        fit_form(tmp_path, callback, model, make_batch, LENGTHS)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, dict(initial.named_parameters())[name], rtol=0, atol=0)


def test_lengths_with_a_named_pad_id_checks_a_batch_without_a_mask():
    batch = collate([TokenSequences([4, 2], seed=0)[i] for i in range(2)], left=True)
    del batch["attention_mask"]
    sequences = PaddedSequences(lengths=lambda b: (b["input_ids"] != 0).sum(1), padding={"input_ids": 0})
    with pytest.raises(ValueError, match=r"sample 1 .* `batch\['input_ids'\]` holds a value other than its padding 0"):
        sequences.cut(batch)
    right = collate([TokenSequences([4, 2], seed=0)[i] for i in range(2)])
    assert sequences.cut(right).lengths == [4, 2]  # right padding passes the same check


def test_lengths_on_right_padded_data_with_a_mask_is_exact(tmp_path):
    make_batch = functools.partial(collate, pad_to=12)
    model = TinyCausalLM(lr=LR)
    callback = AutoMicroBatching(
        sequences=PaddedSequences(lengths=left_padded_lengths),  # the same lengths: right padding is what they mean
        micro_batch_tokens=24,
        pin_micro_batch_size=True,
        count_items=CountTokens("labels", shift=1),
    )
    expected, _ = fit_form(tmp_path, callback, model, make_batch, LENGTHS)
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "counter",
    [CountTokens("labels", shift=1), lambda b: (b["labels"][:, 1:] != -100).sum()],
    ids=["CountTokens", "lambda"],
)
def test_labels_that_score_padding_stop_the_step_before_any_update(tmp_path, counter):
    # labels = input_ids with no -100: the trim dropped the padding's terms, 0.99 of the update off, no warning.
    make_batch = functools.partial(collate, labels_on_padding=True, pad_to=12)
    model = TinyCausalLM(lr=LR)
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(
        sequences=PaddedSequences(), micro_batch_tokens=24, pin_micro_batch_size=True, count_items=counter
    )
    step = make_batch([TokenSequences(LENGTHS, seed=5)[i] for i in range(8)])
    scored = int((step["labels"][:, 1:] != -100).sum())  # what the full-batch loss averages over
    with pytest.raises(
        ValueError,
        match=rf"`count_items` \(.*\) counts {scored} items in the step batch, but \d+ in its micro-batches trimmed"
        r".*labels\[attention_mask == 0\] = -100",
    ):
        fit_form(tmp_path, callback, model, make_batch, LENGTHS)
    assert model.step_grads == []  # no step finished
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, dict(initial.named_parameters())[name], rtol=0, atol=0)


def test_labels_that_score_padding_split_by_samples_are_exact(tmp_path):
    # The fix the message names for scoring padding on purpose: split by samples, which trims nothing.
    make_batch = functools.partial(collate, labels_on_padding=True, pad_to=12)
    model = TinyCausalLM(lr=LR)
    callback = AutoMicroBatching(3, pin_micro_batch_size=True, count_items=CountTokens("labels", shift=1))
    expected, _ = fit_form(tmp_path, callback, model, make_batch, LENGTHS)
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)


FEATURES = 12  # a per-sample vector as long as the padding


class FeatureLM(AnyMaskLM):
    """Adds a per-sample ``[B, 12]`` feature vector's projection and a shared ``[40]`` bias to every position."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(1)
        self.features = torch.nn.Linear(FEATURES, 40)

    def loss(self, batch):
        logits = self(batch["input_ids"], batch["attention_mask"])
        # A shape error where `features` was trimmed; a broadcast error where `token_bias` was cut per sample.
        logits = logits + self.features(batch["features"])[:, None, :] + batch["token_bias"]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        )


def features_of(batch):
    g = torch.Generator().manual_seed(int(batch["index"].sum()))
    return torch.randn(len(batch["index"]), FEATURES, generator=g)


def shared_bias(batch):
    return torch.linspace(-1, 1, 40)


def test_named_fields_and_shared_parts_are_cut_as_named_and_exact(tmp_path):
    # A per-sample [B, 12] vector in a batch padded to 12 was trimmed like a sequence (a shape error in the model),
    # and a shared [40] tensor in a step batch of 40 samples was cut per micro-batch (an error in the loss).
    make_batch = functools.partial(collate, pad_to=FEATURES, features=features_of, token_bias=shared_bias)
    model = FeatureLM(lr=LR)
    sequences = PaddedSequences(fields=["input_ids", "labels"], shared=["token_bias"])
    callback = AutoMicroBatching(
        sequences=sequences, micro_batch_tokens=48, pin_micro_batch_size=True, count_items=CountTokens(shift=1)
    )
    lengths = (LENGTHS * 5)[:80]
    expected, _ = fit_form(tmp_path, callback, model, make_batch, lengths, step_batch=40)
    assert len(model.step_grads) == 2 and len(model.micro_batch_shapes) > 2
    h.assert_grads_close(model.step_grads, expected, rtol=1e-5, atol=1e-6)


def test_the_default_rules_say_how_they_read_parts_that_could_be_either():
    make_batch = functools.partial(collate, pad_to=FEATURES, features=features_of, token_bias=shared_bias)
    dataset = TokenSequences((LENGTHS * 3)[:40], seed=5)
    batch = make_batch([dataset[i] for i in range(40)])
    with pytest.warns(
        UserWarning,
        match=r"trimmed as sequence fields \(their dim 1 has the padded length 12\): `batch\['features'\]` \(40, 12\);"
        r" cut per sample \(their length is the 40 samples\): `batch\['token_bias'\]` \(40,\)\. Name them",
    ):
        cut = PaddedSequences().cut(batch)
    assert tuple(cut.split(batch, 48)[0].batch["features"].shape) == (5, 9)  # the default rules: trimmed
    named = PaddedSequences(fields=["input_ids", "labels"], shared=["token_bias"])
    micro = named.cut(batch).split(batch, 48)[0].batch
    assert tuple(micro["features"].shape) == (5, FEATURES) and micro["token_bias"] is batch["token_bias"]
    assert tuple(micro["input_ids"].shape) == tuple(micro["attention_mask"].shape) == (5, 9)  # the mask: a field


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fields": ["input_ids", "features"]}, ValueError, r"names `batch\['features'\]`, of shape \(2, 12\), but"),
        ({"fields": ["inputs"]}, ValueError, r"names 'inputs', but the batch has no such part"),
        ({"shared": ["bias"]}, ValueError, r"`PaddedSequences\(shared=...\)` names 'bias', but the batch has no"),
        ({"fields": ["labels"], "shared": ["labels"]}, ValueError, r"\['labels'\] is in both `fields`"),
        ({"fields": "labels"}, TypeError, r"`fields` must be a list of the batch's keys"),
    ],
)
def test_fields_and_shared_that_do_not_fit_the_batch_are_refused(kwargs, error, match):
    batch = collate([TokenSequences([4, 2], seed=0)[i] for i in range(2)], features=lambda b: torch.zeros(2, 12))
    batch["features"] = torch.zeros(2, 12)
    with pytest.raises(error, match=match):
        PaddedSequences(**kwargs).cut(batch)


def test_a_shared_tensor_of_another_length_names_shared_in_the_error():
    batch = collate([TokenSequences([4, 2], seed=0)[i] for i in range(2)], token_bias=shared_bias)
    with pytest.raises(ValueError, match=r"`batch\['token_bias'\]`.*PaddedSequences\(shared=\[\.\.\.\]\)"):
        PaddedSequences().cut(batch)
    assert PaddedSequences(shared=["token_bias"]).cut(batch).lengths == [4, 2]


def test_fields_shared_and_padding_come_from_lightning_cli_yaml(tmp_path, monkeypatch):
    import sys

    import yaml

    from tests.test_cli_config import build_from

    monkeypatch.setattr(sys, "argv", ["main.py"])
    sequences = {
        "class_path": "lightning_accum.sequences.PaddedSequences",
        "init_args": {
            "mask": "attention_mask",
            "fields": ["input_ids", "labels"],
            "shared": ["token_bias"],
            "padding": {"input_ids": 0, "labels": -100},
        },
    }
    callback = {"class_path": "lightning_accum.AutoMicroBatching", "init_args": {"sequences": sequences}}
    config = tmp_path / "tokens.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    cli = build_from(tmp_path, config)
    (built,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    assert built.sequences == PaddedSequences(
        mask="attention_mask",
        fields=["input_ids", "labels"],
        shared=["token_bias"],
        padding={"input_ids": 0, "labels": -100},
    )
