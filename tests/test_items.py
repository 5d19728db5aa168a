"""Built-in item counters and ``resolve_counter``."""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_accum.core.normalization import count_items
from lightning_accum.items import CountSamples, CountTokens, resolve_counter

LABELS = torch.tensor([[5, 7, -100, -100], [3, 4, 9, -100], [-100, -100, -100, -100]])


@dataclass
class _Batch:
    input_ids: Tensor
    labels: Tensor


@pytest.mark.parametrize(
    ("batch", "counter"),
    [
        ({"input_ids": torch.zeros(3, 4), "labels": LABELS}, CountTokens()),
        ((torch.zeros(3, 4), LABELS), CountTokens(key=1)),
        ([torch.zeros(3, 4), LABELS], CountTokens(key=-1)),
        (_Batch(torch.zeros(3, 4), LABELS), CountTokens(key="labels")),
    ],
    ids=["dict", "tuple", "list-negative-index", "attribute"],
)
def test_count_tokens_counts_loss_bearing_labels(batch: Any, counter: CountTokens) -> None:
    n = counter(batch)
    assert isinstance(n, Tensor) and n.dim() == 0 and not n.is_floating_point()
    assert int(n) == 2 + 3 + 0


def test_count_tokens_honours_ignore_index() -> None:
    labels = torch.tensor([[0, 1, 0], [2, 0, 0]])
    assert int(CountTokens(key="y", ignore_index=0)({"y": labels})) == 2


def test_count_tokens_stays_on_the_device() -> None:
    # On the meta device no value can be read back: the count must be a lazy tensor, never a host int.
    labels = torch.empty(4, 16, dtype=torch.long, device="meta")
    n = CountTokens()({"labels": labels})
    assert n.device.type == "meta" and n.dtype == torch.int64


def test_count_tokens_passes_the_callbacks_checks() -> None:
    n = count_items({"labels": LABELS}, CountTokens())
    assert isinstance(n, Tensor) and n.shape == () and int(n) == 5


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ({"targets": LABELS}, KeyError, r"the batch has no 'labels'; its keys are \['targets'\]"),
        ({"labels": [1, 2]}, TypeError, r"expects a tensor of labels at batch\['labels'\], got list"),
        (LABELS, KeyError, "cannot find labels in a batch of type Tensor"),
    ],
)
def test_count_tokens_explains_a_batch_it_cannot_read(batch: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CountTokens()(batch)


def test_count_tokens_rejects_an_out_of_range_position() -> None:
    with pytest.raises(KeyError, match="the batch is a sequence of length 2"):
        CountTokens(key=2)((LABELS, LABELS))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": 1.5}, r"`key` must be a str .* got 1.5 of type float"),
        ({"key": True}, "`key` must be a str"),
        ({"ignore_index": "-100"}, r"`ignore_index` must be an int, got '-100' of type str\. .* such as -100"),
    ],
)
def test_count_tokens_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        CountTokens(**kwargs)


def test_count_samples_counts_the_first_dimension() -> None:
    assert CountSamples()({"input_ids": torch.zeros(3, 4), "labels": LABELS}) == 3
    assert count_items((torch.zeros(7, 2),), CountSamples()) == 7


def test_counters_pickle_and_compare() -> None:
    # `ddp_spawn` pickles callbacks, and with them their counters: lambdas would fail here.
    counter = CountTokens(key="targets", ignore_index=0)
    restored = pickle.loads(pickle.dumps(counter))
    assert restored == counter and hash(restored) == hash(counter) and restored != CountTokens()
    assert pickle.loads(pickle.dumps(CountSamples())) == CountSamples()
    assert repr(counter) == "CountTokens(key='targets', ignore_index=0)"


def _count_rows(batch: Any) -> int:
    return len(batch)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ("lightning_accum.items.CountTokens", CountTokens()),
        ("lightning_accum.items:CountSamples", CountSamples()),
        ("lightning_accum.core.normalization.batch_size_of", None),  # a function: checked by identity below
        ("lightning_accum.core.normalization:batch_size_of", None),
    ],
)
def test_resolve_counter_imports_paths(spec: str | None, expected: Any) -> None:
    from lightning_accum.core.normalization import batch_size_of

    resolved = resolve_counter(spec)
    if spec is not None and spec.endswith("batch_size_of"):
        assert resolved is batch_size_of
    else:
        assert resolved == expected


def test_resolve_counter_passes_callables_through() -> None:
    counter = CountTokens()
    assert resolve_counter(counter) is counter
    assert resolve_counter(_count_rows) is _count_rows


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("batch_size_of", ValueError, r"`count_items='batch_size_of'` is not an import path"),
        ("no_such_package.count", ValueError, r"cannot import module 'no_such_package'"),
        ("lightning_accum.items.CountWords", ValueError, r"'lightning_accum.items' has no attribute 'CountWords'"),
        ("math:pi", TypeError, r"`count_items='math:pi'` names 3.14.*, which is not callable"),
        (42, TypeError, r"`count_items` must be a function of a batch, .* got 42 of type int"),
    ],
)
def test_resolve_counter_explains_bad_specs(spec: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_counter(spec)


def test_count_samples_reads_the_batch_as_the_callbacks_do() -> None:
    # A 0-dim value first, and a list of (image, target) samples: the count is the samples, not 1 or the channels.
    assert CountSamples()({"temperature": torch.tensor(0.5), "x": torch.zeros(6, 2)}) == 6
    detection = [(torch.zeros(3, 8, 8), {"boxes": torch.zeros(i + 1, 4)}) for i in range(5)]
    assert CountSamples()(detection) == 5


# ---- issue 18, item 3: `shift`, for a model that shifts its labels inside (Hugging Face causal LMs) -----------------

HF_LABELS = torch.tensor([[5, 7, 2, -100], [3, 4, -100, -100]])  # right padding, -100 on it


def hf_count(labels: Tensor) -> Tensor:
    """What a Hugging Face causal LM's loss counts (`transformers.loss.loss_utils.ForCausalLMLoss`)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return (shifted != -100).sum()


@pytest.mark.parametrize(
    "labels",
    [HF_LABELS, torch.tensor([[-100, -100, 8, 9], [-100, 6, 7, -100]]), HF_LABELS.reshape(2, 1, 4)],
    ids=["right-padded", "masked-prompt", "3-dim"],
)
def test_shift_1_counts_what_a_shifting_model_counts(labels: Tensor) -> None:
    # The sequence is the last dimension, as in Hugging Face's `labels[..., 1:]`.
    n = CountTokens("labels", shift=1)({"labels": labels})
    assert isinstance(n, Tensor) and n.shape == () and int(n) == int(hf_count(labels))
    assert int(CountTokens("labels", shift=0)({"labels": labels})) == int((labels != -100).sum())


def test_shift_longer_than_the_sequences_counts_nothing() -> None:
    assert int(CountTokens(shift=4)({"labels": HF_LABELS})) == 0


def test_shift_keeps_the_count_on_the_device() -> None:
    labels = torch.empty(4, 16, dtype=torch.long, device="meta")
    n = CountTokens(shift=1)({"labels": labels, "input_ids": labels})
    assert n.device.type == "meta" and n.dtype == torch.int64


@pytest.mark.parametrize(
    ("shift", "error", "match"),
    [
        (-1, ValueError, r"`shift` must be an int >= 0 or None, got -1\. Pass 1 for a model that shifts"),
        ("1", TypeError, r"`shift` must be an int >= 0 or None, got '1' of type str"),
        (True, TypeError, r"`shift` must be an int >= 0 or None, got True of type bool"),
        (1.0, TypeError, r"`shift` must be an int >= 0 or None, got 1.0 of type float"),
    ],
)
def test_shift_rejects_bad_values(shift: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CountTokens(shift=shift)


def test_shift_needs_a_sequence_dimension() -> None:
    with pytest.raises(ValueError, match=r"batch\['labels'\] is a 0-dim tensor.* or pass `shift=0`"):
        CountTokens(shift=1)({"labels": torch.tensor(3)})


def test_shift_is_part_of_repr_eq_hash_and_pickles() -> None:
    counter = CountTokens("labels", shift=1)
    assert repr(counter) == "CountTokens(key='labels', ignore_index=-100, shift=1)"
    assert repr(CountTokens()) == "CountTokens(key='labels', ignore_index=-100)"
    assert counter == CountTokens(shift=1) and hash(counter) == hash(CountTokens(shift=1))
    assert counter != CountTokens() and counter != CountTokens(shift=0) and CountTokens(shift=0) != CountTokens()
    restored = pickle.loads(pickle.dumps(counter))
    assert restored == counter and restored.shift == 1


def shift_warnings(counter: CountTokens, *batches: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            counter(batch)
    return [str(w.message) for w in caught]


SHIFTING = {"input_ids": HF_LABELS.clamp(min=0), "labels": HF_LABELS}  # labels = input ids, -100 on padding


def test_labels_equal_to_the_input_ids_warn_once_with_the_fix() -> None:
    counter = CountTokens()
    messages = shift_warnings(counter, SHIFTING, SHIFTING, SHIFTING)
    assert messages == [
        "`CountTokens(key='labels', ignore_index=-100)` sees labels equal to the batch's `input_ids` (wherever they"
        " are not -100): the sign of a model that shifts its labels inside, as Hugging Face causal LMs do. Such a"
        " model's loss averages over `labels[..., 1:]`, one label fewer per sequence than this counter counts, and"
        " the accumulated gradient is then not the full-batch one. Pass `shift=1` (`CountTokens('labels', shift=1)`),"
        " or `shift=0` if your loss does use every label."
    ]
    assert shift_warnings(counter, SHIFTING) == []  # once per counter instance
    assert len(shift_warnings(CountTokens(), SHIFTING)) == 1  # and again for another one


@dataclass
class _Encoding:
    input_ids: Tensor
    labels: Tensor


def test_the_warning_reads_input_ids_of_attribute_batches_and_masked_prompts() -> None:
    masked_prompt = torch.tensor([[-100, -100, 8, 9], [-100, 6, 7, -100]])
    ids = torch.tensor([[1, 2, 8, 9], [4, 6, 7, 0]])
    assert len(shift_warnings(CountTokens(), {"input_ids": ids, "labels": masked_prompt})) == 1
    assert len(shift_warnings(CountTokens(), _Encoding(ids, masked_prompt))) == 1


@pytest.mark.parametrize(
    ("counter", "batch"),
    [
        (CountTokens(shift=1), SHIFTING),
        (CountTokens(shift=0), SHIFTING),  # the user says the loss uses every label
        (CountTokens(), {"input_ids": HF_LABELS.clamp(min=0), "labels": HF_LABELS.roll(-1, dims=-1)}),  # pre-shifted
        (CountTokens(), {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": HF_LABELS}),  # other shapes
        (CountTokens(), {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.full((2, 4), -100)}),
        (CountTokens(key=1), (HF_LABELS.clamp(min=0), HF_LABELS)),  # a tuple batch names no input ids
        (CountTokens(), {"labels": HF_LABELS}),
    ],
    ids=["shift-1", "shift-0", "pre-shifted-labels", "other-shape", "all-padding", "tuple", "no-input-ids"],
)
def test_the_warning_stays_quiet_where_nothing_points_at_a_shifting_model(counter: CountTokens, batch: Any) -> None:
    assert shift_warnings(counter, batch) == []


def test_the_warning_looks_at_the_first_batch_only() -> None:
    # The check reads a value back from the device: once per counter, not on every micro-batch.
    pre_shifted = {"input_ids": HF_LABELS.clamp(min=0), "labels": HF_LABELS.roll(-1, dims=-1)}
    assert shift_warnings(CountTokens(), pre_shifted, SHIFTING) == []
    # A batch without values to compare (meta) is no evidence either way: the next one is checked.
    meta = torch.empty(2, 4, dtype=torch.long, device="meta")
    assert len(shift_warnings(CountTokens(), {"input_ids": meta, "labels": meta}, SHIFTING)) == 1


def test_shift_from_lightning_cli_yaml(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_accum import AccumulationScheduler
    from tests.helpers import RegressionModel

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_accum.AccumulationScheduler\n"
        "      init_args:\n"
        "        schedule: 2\n"
        "        count_items:\n"
        "          class_path: lightning_accum.items.CountTokens\n"
        "          init_args: {key: labels, ignore_index: -100, shift: 1}\n"
    )
    monkeypatch.setattr("sys.argv", ["main.py"])
    cli = LightningCLI(
        RegressionModel,
        run=False,
        save_config_callback=None,
        seed_everything_default=False,
        args=[f"--config={config}", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"],
    )
    (scheduler,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationScheduler)]
    assert scheduler.count_items == CountTokens("labels", shift=1)
    assert int(scheduler.count_items({"labels": HF_LABELS})) == int(hf_count(HF_LABELS))
