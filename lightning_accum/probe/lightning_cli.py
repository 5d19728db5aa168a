"""The model and data that the user's own `LightningCLI` builds from a config, with its ``link_arguments`` applied.

A config that relies on links (``parser.link_arguments("data.vocab_size", "model.vocab_size")``) only builds the right
model through the CLI that declares them. The probe therefore runs the user's CLI class as ``fit --config ...`` would,
up to the point where it would build the `Trainer`, and takes the model and datamodule it built: the same parser, the
same links, the same instantiators. No trainer, strategy or process group is created.
"""

from __future__ import annotations

import json
import warnings
from argparse import ArgumentError
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_accum.probe.resolve import import_object


class _Built(Exception):
    """Raised where the CLI would build its trainer: it carries the CLI, whose model and datamodule are built."""

    def __init__(self, cli: LightningCLI) -> None:
        super().__init__("built")
        self.cli = cli


def build_with_cli(
    cli: str,
    configs: Sequence[str | Path],
    model_class: str | None = None,
    data_class: str | None = None,
    model_init_args: Mapping[str, Any] | None = None,
    data_init_args: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, Any]:
    """Return the model and datamodule that ``cli`` (a `LightningCLI` subclass's import path) builds for ``fit``.

    ``configs`` are passed as ``--config`` in order; ``model_class``/``data_class`` are the classes the CLI is built
    around (``LightningCLI(MyModel, MyData)``), when the CLI class does not default them; ``model_init_args`` and
    ``data_init_args`` override the config's values, as ``--model.KEY=VALUE`` would.

    Raises:
        TypeError: ``cli`` is not a `LightningCLI` subclass.
        ValueError: the CLI's parser refuses the config or the overrides.
        ImportError: an import path names no module or attribute.
    """
    cli_class = import_object(cli, "cli")
    if not (isinstance(cli_class, type) and issubclass(cli_class, LightningCLI)):
        raise TypeError(
            f"`cli`={cli!r} is not a LightningCLI subclass. Pass the class your script builds, e.g. "
            "`--cli my_pkg.main:MyCLI`."
        )

    class ProbeCLI(cli_class):  # type: ignore[misc,valid-type]  # a class known only at run time
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            raise _Built(self)

    argv = ["fit", *(a for path in configs for a in ("--config", str(path)))]
    argv += _overrides("model", model_init_args) + _overrides("data", data_init_args)
    classes: dict[str, Any] = {}
    if model_class is not None:
        classes["model_class"] = import_object(model_class, "model")
    if data_class is not None:
        classes["datamodule_class"] = import_object(data_class, "data")
    strict = {"exit_on_error": False}
    try:
        with warnings.catch_warnings():
            # The probe passes `args` while its own command line is in sys.argv, on purpose.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter", category=UserWarning)
            ProbeCLI(**classes, args=argv, run=True, parser_kwargs={**strict, "fit": strict}, save_config_callback=None)
    except _Built as built:
        return built.cli.model, getattr(built.cli, "datamodule", None)
    except (ArgumentError, SystemExit) as err:
        shown = ", ".join(repr(str(p)) for p in configs)
        raise ValueError(
            f"`config`={shown}: {cli} refuses it, with `module_init_args`={dict(model_init_args or {})!r} and "
            f"`data_init_args`={dict(data_init_args or {})!r} ({' '.join(str(err).split())}). Fix what it names: "
            "`fit --config` must run with the same config."
        ) from None
    raise TypeError(f"`cli`={cli!r} never built a trainer for `fit`: the probe needs a CLI that instantiates one.")


def _overrides(section: str, init_args: Mapping[str, Any] | None) -> list[str]:
    # JSON is YAML, which is how jsonargparse reads a command-line value.
    return [f"--{section}.{key}={json.dumps(value)}" for key, value in (init_args or {}).items()]
