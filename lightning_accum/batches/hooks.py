"""The user's hooks that count and cut batches, over the built-in rules: `BatchHooks` and `resolve_batch_hooks`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_accum._util.validation import as_whole_number, check_int, check_int_worded, import_object
from lightning_accum.batches.plan import BatchPlan, MicroBatch, _plan, batch_size_of

# A user hook `split_batch(batch, micro_batch_size) -> list of micro-batches`, and `batch_size_of(batch) -> int`.
# Typed loosely on purpose: jsonargparse (LightningCLI) must accept them given as import paths in YAML.
SplitBatchFn = Callable[[Any, int], Any]
BatchSizeFn = Callable[[Any], Any]

_BUILT_IN = "the built-in rules"


@dataclasses.dataclass(frozen=True)
class BatchHooks:
    """How a callback counts and cuts batches: the user's hooks where given, the built-in rules otherwise.

    Build it with `resolve_batch_hooks`; the defaults are the built-in rules.

    Args:
        split_batch: the user's ``split_batch(batch, micro_batch_size)``, or ``None`` for `split_batch`.
        batch_size_of: the user's ``batch_size_of(batch)``, or ``None`` for `batch_size_of`.
        split_batch_source: where ``split_batch`` came from, for messages.
        batch_size_of_source: where ``batch_size_of`` came from, for messages.

    Examples:
        >>> import torch
        >>> hooks = resolve_batch_hooks(None)
        >>> hooks.batch_size({"x": torch.zeros(5, 2)})
        5
        >>> [m.size for m in hooks.split({"x": torch.zeros(5, 2)}, 2)]
        [2, 2, 1]
    """

    split_batch: SplitBatchFn | None = None
    batch_size_of: BatchSizeFn | None = None
    split_batch_source: str = _BUILT_IN
    batch_size_of_source: str = _BUILT_IN

    def batch_size(self, batch: Any) -> int:
        """The number of samples in ``batch``, from the user's ``batch_size_of`` hook or the built-in rules.

        Raises:
            TypeError: the hook returned something that is not an int (a NumPy or single-element tensor integer
                is accepted).
            ValueError: the hook returned a negative number.
        """
        if self.batch_size_of is None:
            return batch_size_of(batch)
        return _check_count(self.batch_size_of(batch), f"`batch_size_of` ({self.batch_size_of_source})")

    def plan(self, batch: Any, shared: frozenset[str] = frozenset()) -> BatchPlan:
        """The built-in rules' `BatchPlan` of ``batch``, read at the number of samples these hooks count.

        Without a ``batch_size_of`` hook this is `batch_size_of`'s own reading; with one, the reading that gives the
        hook's count. The ``split_batch`` hook plays no part: the plan cuts by the built-in rules. The parts at the
        paths in ``shared`` are shared by all samples (see `lightning_accum.batches.plan_batch`).

        Raises:
            TypeError: as `batch_size` does, or the batch is an object the built-in rules can't cut.
            ValueError: as `batch_size` does, or the batch can't be read as that many samples.
        """
        if self.batch_size_of is None:
            return _plan(batch, None, "", "count", shared)
        source = f"`batch_size_of` ({self.batch_size_of_source})"
        return _plan(batch, self.batch_size(batch), source, "split", shared)

    def split(self, batch: Any, micro_batch_size: int) -> list[MicroBatch]:
        """Cut ``batch`` into micro-batches of at most ``micro_batch_size`` samples, with their sizes.

        The user's ``split_batch`` hook must return a list (or tuple) of micro-batches, each holding 1 to
        ``micro_batch_size`` samples, whose sizes add up to the step batch's: no sample dropped or repeated. Their
        sizes are read with `batch_size`.

        Raises:
            TypeError: the hook returned something other than a list or tuple.
            ValueError: the micro-batches' sizes break the contract above (the message shows them).
        """
        check_int(micro_batch_size, "micro_batch_size", minimum=1)
        if self.split_batch is None:
            return self.plan(batch).split(micro_batch_size)
        total = self.batch_size(batch)
        name = f"`split_batch` ({self.split_batch_source})"
        result = self.split_batch(batch, micro_batch_size)
        if not isinstance(result, (list, tuple)):
            raise TypeError(
                f"{name} must return a list of micro-batches, got {type(result).__name__}. Return e.g."
                " `[batch[i : i + micro_batch_size] for i in range(0, len(batch), micro_batch_size)]`."
            )
        sizes = [self.batch_size(micro) for micro in result]
        for index, size in enumerate(sizes):
            if not 1 <= size <= micro_batch_size:
                raise ValueError(
                    f"{name}: micro-batch {index} holds {size} samples, more than `micro_batch_size={micro_batch_size}`"
                    if size > micro_batch_size
                    else f"{name}: micro-batch {index} holds {size} samples; every micro-batch must hold 1 to"
                    f" `micro_batch_size={micro_batch_size}` samples, so that memory planning holds."
                )
        if sum(sizes) != total:
            raise ValueError(
                f"{name} returned micro-batches of {' + '.join(map(str, sizes)) or '0'} = {sum(sizes)} samples for a"
                f" step batch of {total} samples. They must add up to the step batch: no sample dropped or repeated."
            )
        return [MicroBatch(micro, size) for micro, size in zip(result, sizes, strict=True)]


def resolve_batch_hooks(
    module: object | None = None,
    *,
    split_batch: SplitBatchFn | str | None = None,
    batch_size_of: BatchSizeFn | str | None = None,
) -> BatchHooks:
    """The hooks that count and cut batches: an argument, else a method of ``module``, else the built-in rules.

    Args:
        module: the LightningModule (or ``None``); a ``split_batch(self, batch, micro_batch_size)`` or
            ``batch_size_of(self, batch)`` method on it is used where the argument is ``None``.
        split_batch: a function ``split_batch(batch, micro_batch_size)`` returning a list of micro-batches, or its
            import path (``"package.module.function"``).
        batch_size_of: a function ``batch_size_of(batch)`` returning the number of samples, or its import path.

    Raises:
        TypeError: a hook is not callable (as an argument, or as an attribute of ``module``).
        ValueError: an import path is malformed or cannot be imported.

    Examples:
        >>> def by_len(batch):
        ...     return len(batch["ids"])
        >>> hooks = resolve_batch_hooks(None, batch_size_of=by_len)
        >>> hooks.batch_size({"ids": [3, 1, 4]}), hooks.batch_size_of_source
        (3, 'the `batch_size_of=` argument (by_len)')
    """
    split_fn, split_source = _pick_hook("split_batch", "split_batch(batch, micro_batch_size)", split_batch, module)
    size_fn, size_source = _pick_hook("batch_size_of", "batch_size_of(batch)", batch_size_of, module)
    return BatchHooks(split_fn, size_fn, split_source, size_source)


def _pick_hook(name: str, signature: str, given: Any, module: object | None) -> tuple[Any, str]:
    if given is not None:
        if isinstance(given, str):
            target = import_object(given, name)
            if not callable(target):
                raise TypeError(
                    f"`{name}={given!r}` names {target!r}, which is not callable. Name a function {signature}."
                )
            return target, f"the `{name}=` argument ({given})"
        if not callable(given):
            raise TypeError(f"`{name}` must be a function `{signature}`, got {given!r} of type {type(given).__name__}.")
        return given, f"the `{name}=` argument ({getattr(given, '__name__', repr(given))})"
    if module is None:
        return None, _BUILT_IN
    # The instance's own attributes and the class's; never `nn.Module.__getattr__`, which would return a submodule.
    found = vars(module).get(name, getattr(type(module), name, None))
    if found is None:
        return None, _BUILT_IN
    if not callable(found):
        raise TypeError(
            f"`{type(module).__name__}.{name}` must be a method `{signature.replace('(', '(self, ', 1)}`, got"
            f" {found!r}. Rename the attribute, or make it that method."
        )
    hook = found if name in vars(module) else getattr(module, name)
    return hook, f"`{type(module).__name__}.{name}`"


def _check_count(value: Any, name: str) -> int:
    # `as_whole_number` converts only integers, so a count refused here is what the hook returned, shown as it was.
    expected = f"{name} must return an int >= 0 (the number of samples in the batch)"
    return check_int_worded(
        as_whole_number(value),
        0,
        type_error=expected,
        value_error=expected,
        hint="Count samples, not items: a weighted count belongs in `count_items`.",
    )


# ----------------------------------------------------------------------------------------------------------------------
# reading a batch
