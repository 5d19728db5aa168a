"""Argument checks shared by the modules.

Every message names the argument in backticks, says what was expected, shows the value received and, given a
``hint``, says how to fix it:

>>> check_int(0, "grow_patience", 1, hint="It counts optimizer steps.")
Traceback (most recent call last):
    ...
ValueError: `grow_patience` must be an int >= 1, got 0. It counts optimizer steps.
"""

from __future__ import annotations

import math
import pkgutil
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

_Choice = TypeVar("_Choice", bound=str)


def check_int(
    value: Any,
    name: str | None,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    alternative: str = "",
    hint: str = "",
) -> int:
    """``value`` if it is an int in ``[minimum, maximum]``; a bound of ``None`` leaves that end open.

    Args:
        value: what the user passed.
        name: the argument as the user wrote it (``"schedule[0]"`` works too); ``None`` leaves it out of the message,
            for a check that doesn't know its argument (a LightningCLI type: the parser names the argument).
        minimum: the smallest value allowed.
        maximum: the largest value allowed.
        alternative: what else the argument accepts (the caller checks it first), e.g. ``'"auto"'``.
        hint: a sentence that says how to fix the value; it ends the message.

    Raises:
        TypeError: ``value`` is not an int. A bool is refused: ``True`` as a size or a count is always a mistake.
        ValueError: ``value`` is out of bounds.

    Examples:
        >>> check_int(4, "accumulation_steps", 1)
        4
        >>> check_int("8", "micro_batch_size", 1, alternative='"auto"')
        Traceback (most recent call last):
            ...
        TypeError: `micro_batch_size` must be an int >= 1 or "auto", got '8' of type str.
        >>> check_int(-3, None, 1)
        Traceback (most recent call last):
            ...
        ValueError: must be an int >= 1, got -3.
    """
    expected = _expected("an int", _bounds(minimum, maximum), alternative)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(_message(name, expected, value, hint, with_type=True))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(_message(name, expected, value, hint))
    return value


def check_int_worded(value: Any, minimum: int, *, type_error: str, value_error: str, hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum``, for a check whose messages say more than `check_int`'s words.

    Args:
        value: what the user passed (or what their code returned).
        minimum: the smallest value allowed.
        type_error: what the message about a wrong type starts with, e.g. ``"`n` must be an int (steps)"``; it goes on
            with the value received and its type.
        value_error: what the message about a value below ``minimum`` starts with; it goes on with the value.
        hint: a sentence that ends the message about a wrong type: how to fix it.

    Raises:
        TypeError: ``value`` is not an int (a bool is refused, as by `check_int`).
        ValueError: ``value < minimum``.

    Examples:
        >>> check_int_worded(-1, 0, type_error="`hook` must return an int", value_error="`hook` must return >= 0")
        Traceback (most recent call last):
            ...
        ValueError: `hook` must return >= 0, got -1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type_error}, got {value!r} of type {type(value).__name__}." + (f" {hint}" if hint else ""))
    if value < minimum:
        raise ValueError(f"{value_error}, got {value}.")
    return value


def check_number(
    value: Any,
    name: str | None,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    kind: str = "number",
    hint: str = "",
) -> float:
    """``value`` as a float if it is a finite int or float between ``minimum`` and ``maximum``.

    Args:
        value: what the user passed.
        name: the argument as the user wrote it (``None``: left out of the message, as in `check_int`).
        minimum: the lower bound (``None``: none).
        maximum: the upper bound (``None``: none).
        min_inclusive: whether ``minimum`` itself is allowed.
        max_inclusive: whether ``maximum`` itself is allowed.
        kind: what the number is, for the message: ``"number of bytes"``, ``"fraction of the budget"``.
        hint: a sentence that says how to fix the value; it ends the message.

    Raises:
        TypeError: ``value`` is not an int or a float (a bool is refused).
        ValueError: ``value`` is NaN, infinite or out of bounds.

    Examples:
        >>> check_number(3, "budget_bytes", 0, min_inclusive=False)
        3.0
        >>> check_number(1.0, "beta", 0, 1, max_inclusive=False, hint="0.99 averages over about 100 windows.")
        Traceback (most recent call last):
            ...
        ValueError: `beta` must be a number in [0, 1), got 1.0. 0.99 averages over about 100 windows.
        >>> check_number(float("inf"), "peak_bytes", 0, kind="number of bytes")
        Traceback (most recent call last):
            ...
        ValueError: `peak_bytes` must be a finite number of bytes >= 0, got inf.
    """
    # With both ends bounded the range already says "finite"; with an open end the word is needed.
    finite = "" if minimum is not None and maximum is not None else "finite "
    article = "an" if (finite or kind)[0] in "aeiou" else "a"
    bounds = _bounds(minimum, maximum, min_inclusive, max_inclusive)
    expected = _expected(f"{article} {finite}{kind}", bounds)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(_message(name, expected, value, hint, with_type=True))
    number = float(value)
    below = minimum is not None and (number < minimum if min_inclusive else number <= minimum)
    above = maximum is not None and (number > maximum if max_inclusive else number >= maximum)
    if not math.isfinite(number) or below or above:
        raise ValueError(_message(name, expected, value, hint))
    return number


def check_choice(
    value: Any, name: str, choices: Iterable[_Choice] | Mapping[_Choice, str], *, hint: str = ""
) -> _Choice:
    """``value`` if it is one of ``choices``: the check for a ``Literal[...]`` option.

    Args:
        value: what the user passed.
        name: the argument as the user wrote it.
        choices: the values allowed, or a mapping from each to what it means (the message explains them).
        hint: a sentence that says how to fix the value; it ends the message.

    Raises:
        ValueError: ``value`` is not one of ``choices`` (whatever its type: a choice is always a string).

    Examples:
        >>> check_choice("step", "unit", ("epoch", "step", "sample"))
        'step'
        >>> check_choice("avg", "loss_reduction", {"mean": "a mean over the items", "sum": "their sum"})
        Traceback (most recent call last):
            ...
        ValueError: `loss_reduction` must be 'mean' (a mean over the items) or 'sum' (their sum), got 'avg'.
    """
    meanings: dict[_Choice, str] = dict(choices) if isinstance(choices, Mapping) else dict.fromkeys(choices, "")
    if isinstance(value, str) and value in meanings:
        return value
    shown = [f"{choice!r} ({meaning})" if meaning else repr(choice) for choice, meaning in meanings.items()]
    expected = " or ".join(shown) if len(shown) <= 2 else f"one of {', '.join(shown)}"
    raise ValueError(_message(name, expected, value, hint))


def check_bool(value: Any, name: str, *, hint: str = "") -> bool:
    """``value`` if it is a bool (``1``, ``"yes"`` and ``None`` are refused).

    Raises:
        TypeError: ``value`` is not a bool.

    Examples:
        >>> check_bool(1, "predictive")
        Traceback (most recent call last):
            ...
        TypeError: `predictive` must be a bool, got 1 of type int.
    """
    if not isinstance(value, bool):
        raise TypeError(_message(name, "a bool", value, hint, with_type=True))
    return value


def _bounds(
    minimum: float | None, maximum: float | None, min_inclusive: bool = True, max_inclusive: bool = True
) -> str:
    if minimum is not None and maximum is not None:
        return f" in {'[' if min_inclusive else '('}{minimum}, {maximum}{']' if max_inclusive else ')'}"
    if minimum is not None:
        return f" {'>=' if min_inclusive else '>'} {minimum}"
    if maximum is not None:
        return f" {'<=' if max_inclusive else '<'} {maximum}"
    return ""


def _expected(noun: str, bounds: str, alternative: str = "") -> str:
    return f"{noun}{bounds}" + (f" or {alternative}" if alternative else "")


def _message(name: str | None, expected: str, value: Any, hint: str, with_type: bool = False) -> str:
    of_type = f" of type {type(value).__name__}" if with_type else ""
    subject = f"`{name}` must" if name is not None else "must"
    return f"{subject} be {expected}, got {value!r}{of_type}." + (f" {hint.strip()}" if hint else "")


def import_object(path: str, name: str | None = None) -> Any:
    """The object an import path names, ``"package.module.attr"`` or ``"package.module:attr"``.

    ``name`` is the argument the path was given as (e.g. ``count_items``); the messages name it. ``None`` leaves it
    out, for a check that doesn't know its argument (a LightningCLI type: the parser names the argument).

    Raises:
        ValueError: the path is malformed, its module can't be imported, or the module has no such attribute.

    Examples:
        >>> import_object("collections:OrderedDict").__name__
        'OrderedDict'
        >>> import_object("collections.NoSuchThing", "count_items")
        Traceback (most recent call last):
            ...
        ValueError: `count_items='collections.NoSuchThing'`: 'collections' has no attribute 'NoSuchThing'.
    """
    given = f"`{name}={path!r}`" if name is not None else repr(path)
    # `pkgutil.resolve_name` reads both forms; it is asked only once the path looks like one, so that a typo gets
    # our message rather than its own.
    module_name, sep, attr_path = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr_path or not sep or " " in path:
        raise ValueError(
            f"{given} is not an import path. Write 'package.module.function' or 'package.module:function'."
        )
    try:
        return pkgutil.resolve_name(path)
    except ImportError as err:
        raise ValueError(f"{given}: cannot import module {err.name or module_name!r} ({err}).") from err
    except AttributeError as err:
        raise ValueError(f"{given}: {module_name!r} has no attribute {attr_path!r}.") from err


def as_whole_number(value: Any) -> Any:
    """``value`` as a Python int if it is an integer (int, NumPy integer, single-element integer tensor), else as is.

    Sample counts come from user code as any of these; bools are left alone so that callers refuse them.
    """
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")  # only if the caller's code already imported it
    if np is not None and isinstance(value, np.integer):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        if not value.is_complex() and value.dtype != torch.bool:
            return int(value.item())
    return value


K_HINT = "Use 1 to disable accumulation."
"""What every message about a bad ``k`` ends with."""


def check_milestones(milestones: Any, unit: str) -> list[int]:
    """Check a ``{progress: k}`` schedule (keys ints >= 0, strictly increasing; values ints >= 1); its keys in order.

    Raises:
        TypeError: ``milestones`` is not a non-empty mapping, or a key or value is not an int.
        ValueError: a key is negative, the keys are not strictly increasing, or a ``k`` is < 1.
    """
    if not isinstance(milestones, Mapping) or not milestones:
        raise TypeError(
            f"`schedule` must be a non-empty mapping {{{unit}: k}}, got {milestones!r}."
            " Example: {0: 1, 4: 2} accumulates 2 micro-batches from the 4th on."
        )
    keys = list(milestones)
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"`schedule` keys must be ints counting {unit}s, got key {key!r} in {milestones!r}.")
        if key < 0:
            raise ValueError(f"`schedule` keys must be >= 0, got key {key} in {dict(milestones)!r}.")
        check_int(milestones[key], f"schedule[{key}]", 1, hint=K_HINT)
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise ValueError(
            f"`schedule` keys must be strictly increasing, got {keys}. Write the mapping in {unit} order,"
            f" e.g. {dict(sorted(milestones.items()))!r}."
        )
    return keys
