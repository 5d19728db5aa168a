"""Argument types that LightningCLI checks while it parses, so that a bad value is a usage error, not a traceback.

The callbacks check their arguments in ``__init__``, but LightningCLI calls ``__init__`` only after parsing, and an
error raised there comes out as a long traceback with the message somewhere in the middle. jsonargparse, the parser
under LightningCLI, checks each value against its parameter's type hint while it parses; a value that fails is a
short usage error that names the argument and shows the value, with a non-zero exit. The types here carry the
``__init__`` checks into that parse:

=====================  ============================  ===========================================================
type                   a type checker sees           the parse accepts
=====================  ============================  ===========================================================
`PositiveInt`          ``int``                       an int >= 1 (a count of steps, windows, samples)
`NonNegativeInt`       ``int``                       an int >= 0
`SeveralMicroBatches`  ``int``                       an int >= 2 (windows long enough to measure the noise scale)
`MicroBatchSize`       ``int | Literal["auto"]``     an int >= 1 or ``"auto"``
`PositiveFloat`        ``float``                     a finite number > 0
`NonNegativeFloat`     ``float``                     a finite number >= 0
`GrowthFactor`         ``float``                     a finite number > 1
`OpenUnitInterval`     ``float``                     a number in (0, 1), e.g. a fraction of the budget
`Decay`                ``float``                     a number in [0, 1): a moving average's decay
`MemorySize`           ``float | int | str``         a ``max_memory`` (`lightning_accum.memory.budget`)
`Milestones`           ``Mapping[int, int]``         a ``{progress: k}`` schedule (`lightning_accum.StepwiseSchedule`)
`ImportPath`           ``str``                       an import path to something callable
=====================  ============================  ===========================================================

For a type checker each name is an alias of the plain type in the middle column, so Python callers pass plain
values and nothing changes for them. At run time each is a class that nothing instantiates: jsonargparse knows it
through ``register_type`` (done here, and only where jsonargparse is installed: it is the ``cli`` extra, never a
requirement), and its deserializer runs the same check as ``__init__`` and hands the callback the plain value.
``__init__`` still checks everything, for Python callers and for what one type can't see: one argument against
another, such as ``micro_batch_size >= min_micro_batch_size`` or a ramp's ``target >= start``.

Why registered types rather than the other ways jsonargparse checks a value: its restricted types (``PositiveInt``
of ``jsonargparse.typing``) would have to be imported by every signature, so jsonargparse would become a
requirement, and they replace our messages with ``-3 does not conform to restriction v>0``; ``Annotated[int,
annotated_types.Gt(0)]`` is checked only where pydantic 2 is installed (jsonargparse hands it to pydantic, with
pydantic's messages, and silently skips the check elsewhere), and no such metadata says what a memory size is. A
registered type runs our own check and message, and costs nothing where jsonargparse is absent.

The parse then reads, for ``--trainer.callbacks.grow_patience=-3``::

    error: Parser key "trainer.callbacks":
      Problem with given class_path 'lightning_accum.AutoMicroBatching':
        Parser key "grow_patience":
          Not of type PositiveInt: must be an int >= 1, got -3.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from lightning_accum._util.validation import check_int, check_milestones, check_number, import_object
from lightning_accum.memory.budget import check_max_memory

if TYPE_CHECKING:
    from typing import TypeAlias

    PositiveInt: TypeAlias = int
    NonNegativeInt: TypeAlias = int
    SeveralMicroBatches: TypeAlias = int
    MicroBatchSize: TypeAlias = int | Literal["auto"]
    PositiveFloat: TypeAlias = float
    NonNegativeFloat: TypeAlias = float
    GrowthFactor: TypeAlias = float
    OpenUnitInterval: TypeAlias = float
    Decay: TypeAlias = float
    MemorySize: TypeAlias = float | int | str
    Milestones: TypeAlias = Mapping[int, int]
    ImportPath: TypeAlias = str
else:

    class PositiveInt(int):
        """An int >= 1, checked while LightningCLI parses (a plain ``int`` to a type checker)."""

    class NonNegativeInt(int):
        """An int >= 0, checked while LightningCLI parses (a plain ``int`` to a type checker)."""

    class SeveralMicroBatches(int):
        """An int >= 2, checked while LightningCLI parses (a plain ``int`` to a type checker)."""

    class MicroBatchSize:
        """An int >= 1 or ``"auto"``, checked while LightningCLI parses (``int | Literal["auto"]``)."""

    class PositiveFloat(float):
        """A finite number > 0, checked while LightningCLI parses (a plain ``float`` to a type checker)."""

    class NonNegativeFloat(float):
        """A finite number >= 0, checked while LightningCLI parses (a plain ``float`` to a type checker)."""

    class GrowthFactor(float):
        """A finite number > 1, checked while LightningCLI parses (a plain ``float`` to a type checker)."""

    class OpenUnitInterval(float):
        """A number in (0, 1), checked while LightningCLI parses (a plain ``float`` to a type checker)."""

    class Decay(float):
        """A number in [0, 1), checked while LightningCLI parses (a plain ``float`` to a type checker)."""

    class MemorySize:
        """A ``max_memory`` budget, checked while LightningCLI parses (``float | int | str`` to a type checker)."""

    class Milestones(dict):
        """A ``{progress: k}`` schedule, checked while LightningCLI parses (``Mapping[int, int]`` to a type checker)."""

    class ImportPath(str):
        """An import path to something callable, checked while LightningCLI parses (``str`` to a type checker)."""


def _memory_size(value: Any) -> Any:
    # jsonargparse used to read `max_memory: 1` through a `float | int` hint, as the fraction 1.0 (the whole device),
    # and docs/cli.md promises that; a whole float above 1 is still bytes (`check_max_memory`).
    if isinstance(value, int):
        value = float(value)
    check_max_memory(value)
    return value  # as written ("6GiB" stays a string): the callback records what the user gave


def _milestones(value: Any) -> dict[int, int]:
    check_milestones(value, "epoch")  # `StepwiseSchedule`'s checks and messages
    return dict(value)


def _import_path(value: str) -> str:
    target = import_object(value)
    if not callable(target):
        raise TypeError(f"{value!r} names {target!r}, which is not callable. Name a function or a class.")
    return value


class _Kind(NamedTuple):
    expected: str  # for a value of the wrong type
    accepts: tuple[type, ...]  # the Python types (after YAML) that reach `check`; a bool is never a number
    check: Callable[[Any], Any]


_NUMBER = (int, float)
_KINDS: dict[str, _Kind] = {
    "PositiveInt": _Kind("an int >= 1", (int,), lambda v: check_int(v, None, 1)),
    "NonNegativeInt": _Kind("an int >= 0", (int,), lambda v: check_int(v, None, 0)),
    "SeveralMicroBatches": _Kind("an int >= 2", (int,), lambda v: check_int(v, None, 2)),
    "MicroBatchSize": _Kind(
        'an int >= 1 or "auto"', (int, str), lambda v: v if v == "auto" else check_int(v, None, 1, alternative='"auto"')
    ),
    "PositiveFloat": _Kind("a number > 0", _NUMBER, lambda v: check_number(v, None, 0, min_inclusive=False)),
    "NonNegativeFloat": _Kind("a number >= 0", _NUMBER, lambda v: check_number(v, None, 0)),
    "GrowthFactor": _Kind("a number > 1", _NUMBER, lambda v: check_number(v, None, 1, min_inclusive=False)),
    "OpenUnitInterval": _Kind(
        "a number in (0, 1)", _NUMBER, lambda v: check_number(v, None, 0, 1, min_inclusive=False, max_inclusive=False)
    ),
    "Decay": _Kind("a number in [0, 1)", _NUMBER, lambda v: check_number(v, None, 0, 1, max_inclusive=False)),
    "MemorySize": _Kind(
        "a fraction of device memory in (0, 1], a number of bytes or a size such as '8GiB'",
        (int, float, str),
        _memory_size,
    ),
    "Milestones": _Kind("a {progress: k} mapping such as {0: 1, 4: 2}", (Mapping,), _milestones),
    "ImportPath": _Kind("an import path such as 'package.module:function'", (str,), _import_path),
}
# What YAML and the command line give; anything else is jsonargparse's own (a nested override on its way to another
# branch of a union), and its repr would say nothing to a user.
_PLAIN = (str, int, float, bool, type(None), list, dict)


def check(type_name: str, value: Any) -> Any:
    """The plain value a LightningCLI type hands the callback, after the type's check.

    A string from the command line is read as YAML first (``"-3"`` is the int -3, ``"{0: 1}"`` a mapping), as
    jsonargparse reads it for a plain ``int``.

    Raises:
        TypeError: the value has the wrong type.
        ValueError: the value is out of range (or, for `MemorySize`, not a size).

    Examples:
        >>> check("PositiveInt", "20"), check("MemorySize", "6GiB"), check("Milestones", "{0: 1, 4: 2}")
        (20, '6GiB', {0: 1, 4: 2})
        >>> check("NonNegativeInt", "-3")
        Traceback (most recent call last):
            ...
        ValueError: must be an int >= 0, got -3.
        >>> check("OpenUnitInterval", "high")
        Traceback (most recent call last):
            ...
        TypeError: expected a number in (0, 1), got 'high'.
    """
    kind = _KINDS[type_name]
    if isinstance(value, str):
        value = _yaml_scalar_or_mapping(value)
    if isinstance(value, bool) or not isinstance(value, kind.accepts):
        got = f", got {value!r}" if isinstance(value, _PLAIN) else ""
        raise TypeError(f"expected {kind.expected}{got}.")
    return kind.check(value)


def _yaml_scalar_or_mapping(text: str) -> Any:
    import yaml  # a requirement of jsonargparse, and of Lightning's own config code

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # the check then says what was expected


def _register_with_jsonargparse() -> None:
    """Tell jsonargparse how to read each type: `check` going in, the plain value going out (as YAML writes it).

    Registered at import wherever jsonargparse is installed, since LightningCLI may be imported after this package
    and jsonargparse has no hook to call back. That costs an import of jsonargparse (about 0.1 s) there.
    """
    try:
        from jsonargparse.typing import register_type
    except ImportError:  # no `cli` extra: nothing parses these types, and Python callers never see them
        return
    for name in _KINDS:
        register_type(
            globals()[name],
            serializer=lambda value: value,
            deserializer=lambda value, name=name: check(name, value),
            deserializer_exceptions=(ValueError, TypeError),
        )


_register_with_jsonargparse()
