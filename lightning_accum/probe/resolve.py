"""Turning what the user names (``--model``, ``--data``, ``--config``) into a model factory and a batch factory.

Import paths resolve with `pkgutil.resolve_name`; a LightningCLI config is read and instantiated with jsonargparse,
the parser LightningCLI itself uses, so a section builds here exactly as it would for ``fit``.
"""

from __future__ import annotations

import copy
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

ModuleSpec = nn.Module | Callable[[], nn.Module] | str
DataSpec = Callable[[int], Any] | Any | str


def import_object(path: str, argument: str = "path") -> Any:
    """Import ``"pkg.mod:Name"`` or ``"pkg.mod.Name"`` (`pkgutil.resolve_name`); the messages name ``argument``.

    Raises:
        ValueError: if ``path`` names no module and attribute.
        ImportError: if the module or attribute does not exist.

    Examples:
        >>> import_object("collections:OrderedDict").__name__
        'OrderedDict'
    """
    if not isinstance(path, str) or not path or (":" not in path and "." not in path):
        raise ValueError(f"`{argument}` must be an import path like 'pkg.module:Name', got {path!r}.")
    try:
        return pkgutil.resolve_name(path)
    except ValueError as err:
        raise ValueError(f"`{argument}` must be an import path like 'pkg.module:Name', got {path!r} ({err}).") from err
    except ModuleNotFoundError as err:
        module_name = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        raise ImportError(
            f"`{argument}`={path!r}: cannot import module {module_name!r} ({err}). Check the spelling, and that the "
            "package is installed or its folder is on PYTHONPATH."
        ) from err
    except AttributeError as err:
        raise ImportError(f"`{argument}`={path!r}: {err}.") from err


def check_init_args(target: Any, kwargs: Mapping[str, Any], argument: str, *leading: Any) -> None:
    """Raise a `TypeError` naming ``argument`` when ``target(*leading, **kwargs)`` would not bind."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to check against (some builtins): the call itself will say
        return
    try:
        signature.bind(*leading, **kwargs)
    except TypeError as err:
        name = getattr(target, "__qualname__", type(target).__name__)
        empty = inspect.Parameter.empty
        plain = signature.replace(
            parameters=[p.replace(annotation=empty) for p in signature.parameters.values()], return_annotation=empty
        )
        raise TypeError(
            f"`{argument}`={dict(kwargs)!r} does not fit {name}{plain}: {err}. Pass only the arguments it takes."
        ) from None


def module_factory(module: ModuleSpec, init_args: Mapping[str, Any] | None) -> Callable[[], nn.Module]:
    """A function that builds a fresh module each call, from an instance (copied), a factory or an import path.

    Raises:
        TypeError: ``module`` is none of these, or ``init_args`` do not fit it.
        ValueError: ``init_args`` were given with an instance.
        ImportError: the import path names no module or attribute.
    """
    kwargs = dict(init_args or {})
    if isinstance(module, str):
        target = import_object(module, "module")
        check_init_args(target, kwargs, "module_init_args")
        return lambda: target(**copy.deepcopy(kwargs))
    if isinstance(module, nn.Module):
        if kwargs:
            raise ValueError(
                f"`module_init_args`={kwargs!r} was given with a module instance; init args only apply to an import "
                "path or a factory. Drop them or pass the class."
            )
        template = module
        return lambda: copy.deepcopy(template)
    if callable(module):
        check_init_args(module, kwargs, "module_init_args")
        return lambda: module(**copy.deepcopy(kwargs))
    raise TypeError(
        f"`module` must be an nn.Module, a callable returning one, or an import path 'pkg.mod:Class', got "
        f"{type(module).__name__}."
    )


def batch_factory(data: DataSpec, init_args: Mapping[str, Any] | None, batch_size: int) -> Callable[[int, int], Any]:
    """Return ``make(start, size)``: a batch of ``size`` samples starting at sample ``start`` of the step's window.

    Raises:
        TypeError: ``data`` is neither a datamodule nor a batch factory, or ``init_args`` do not fit it.
        ValueError: the training set holds fewer than ``batch_size`` samples.
        ImportError: the import path names no module or attribute.
    """
    kwargs = dict(init_args or {})
    if isinstance(data, str):
        data = import_object(data, "data")
    if isinstance(data, type):  # a datamodule class: build it with the init args
        check_init_args(data, kwargs, "data_init_args")
        data = data(**kwargs)
        kwargs = {}
    if hasattr(data, "train_dataloader"):  # a LightningDataModule, duck-typed
        return _datamodule_batches(data, batch_size)
    if callable(data):
        check_init_args(data, kwargs, "data_init_args", batch_size)
        factory = data
        return lambda start, size: factory(size, **kwargs)
    raise TypeError(
        f"`data` must be a LightningDataModule, a callable `(micro_batch_size) -> batch`, or an import path to "
        f"either, got {type(data).__name__}."
    )


def _datamodule_batches(datamodule: Any, batch_size: int) -> Callable[[int, int], Any]:
    # Collate micro-batches from the dataset itself, as a DataLoader with batch_size=b would: padding collates then
    # pad each micro-batch to its own longest sample, as in training.
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    dataset = loader.dataset
    collate = loader.collate_fn
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        if len(dataset) < batch_size:
            raise ValueError(
                f"`batch_size`={batch_size} is larger than the training set ({len(dataset)} samples). Lower it."
            )
        samples = [dataset[i] for i in range(batch_size)]
    else:  # an IterableDataset
        iterator = iter(dataset)
        samples = [next(iterator) for _ in range(batch_size)]
    return lambda start, size: collate(samples[start : start + size])


# ---- LightningCLI configs -------------------------------------------------------------------------------------------


def load_cli_config(
    path: str | Path,
    model_class: str | None = None,
    data_class: str | None = None,
    model_init_args: Mapping[str, Any] | None = None,
    data_init_args: Mapping[str, Any] | None = None,
) -> tuple[Callable[[], nn.Module], Callable[[], Any] | None]:
    """Read a LightningCLI YAML config and return factories for its ``model`` and ``data`` sections.

    A section is either ``{class_path: pkg.mod.Class, init_args: {...}}`` or, for a CLI built around one class
    (``LightningCLI(MyModel, MyData)``), the init args themselves; then ``model_class``/``data_class`` name the
    class as an import path. The ``trainer`` section and everything else are ignored. The init args are checked
    against the class's signature here, with jsonargparse as LightningCLI does; each factory call builds a fresh
    object. ``model_init_args``/``data_init_args`` override the sections' init args, key by key. The CLI's
    ``link_arguments`` are not applied here: `lightning_accum.probe.lightning_cli.build_with_cli` runs the CLI itself.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file is not YAML, the model section is missing, or a section has no ``class_path`` and no
            class was given.
        TypeError: if a section's init args do not fit its class.
        ImportError: if a class path names no module or attribute, or jsonargparse is not installed.
    """
    config = _read_yaml(Path(path))
    sections: dict[str, dict[str, Any]] = {}
    overrides = {"model": model_init_args or {}, "data": data_init_args or {}}
    for name, cls, flag in (("model", model_class, "--model"), ("data", data_class, "--data")):
        section = _section(config, name, cls, flag, path)
        if section is not None:
            sections[name] = {**section, "init_args": {**(section.get("init_args") or {}), **overrides[name]}}
    if "model" not in sections:
        raise ValueError(f"`config`={str(path)!r} has no `model` section; the probe needs a model to train.")
    data = sections.get("data")
    return _instantiator(sections["model"], "model", path), None if data is None else _instantiator(data, "data", path)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"`config`={str(path)!r} does not exist. Pass the YAML file given to LightningCLI.")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(
            f"`config`={str(path)!r} is not valid YAML: {problem}{where}. Fix the file, or pass the YAML file given "
            "to LightningCLI."
        ) from err
    if not isinstance(config, Mapping):
        raise ValueError(
            f"`config`={str(path)!r} holds a {type(config).__name__}, not a mapping of sections. Pass the YAML file "
            "given to LightningCLI."
        )
    return config


def _section(
    config: Mapping[str, Any], name: str, cls: str | None, flag: str, path: str | Path
) -> dict[str, Any] | None:
    section = config.get(name)
    if section is None:
        return None if cls is None else {"class_path": cls, "init_args": {}}
    if not isinstance(section, Mapping):
        raise ValueError(f"`config`={str(path)!r}: the `{name}` section must be a mapping, got {section!r}.")
    if "class_path" in section:
        return dict(section)
    if cls is None:
        raise ValueError(
            f"`config`={str(path)!r}: the `{name}` section has no `class_path`. Add one with a full import "
            f"path, or name the class with `{flag} pkg.mod:Class`."
        )
    return {"class_path": cls, "init_args": section.get("init_args", section)}


def _instantiator(section: Mapping[str, Any], name: str, path: str | Path) -> Callable[[], Any]:
    try:
        from jsonargparse import ArgumentParser
    except ModuleNotFoundError as err:
        raise ImportError(
            f"`config`={str(path)!r}: reading a LightningCLI config needs jsonargparse, as LightningCLI does: "
            "pip install 'lightning-accum[cli]'."
        ) from err
    target = import_object(section["class_path"], "class_path")
    init_args = dict(section.get("init_args") or {})
    parser = ArgumentParser(exit_on_error=False)
    if isinstance(target, type):
        parser.add_class_arguments(target, name)
    else:  # a factory function: its parameters are the init args
        parser.add_function_arguments(target, name)
    try:
        parsed = parser.parse_object({name: init_args})
    except Exception as err:  # jsonargparse reports every mismatch as argparse.ArgumentError
        raise TypeError(
            f"`config`={str(path)!r}: the `{name}` section's init args {init_args!r} do not fit "
            f"{section['class_path']}: {' '.join(str(err).split())}. Pass only the arguments it takes."
        ) from None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49

    def build() -> Any:
        built = instantiate(parsed)[name]
        return built if isinstance(target, type) else target(**dict(built))

    return build
