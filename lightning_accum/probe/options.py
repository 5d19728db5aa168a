"""The keywords both probes take, written once with their types and defaults: `ProbeOptions`.

`lightning_accum.probe.probe_memory` and `lightning_accum.probe.tokens.probe_tokens` differ in what they measure
(a grid of ``(b, k)``; shapes ``(L, n)``) but run each configuration the same way, on the same device, against the
same budget: those shared keywords arrive as ``**options: Unpack[ProbeOptions]`` (so a type checker still checks
each one) and are read here, with their defaults, into a `RunOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from lightning_accum.memory.fake import Target


class ProbeOptions(TypedDict, total=False):
    """The keywords `probe_memory` and `probe_tokens` share; each is optional, its default is `RunOptions`'s."""

    warmup_steps: int
    device: str | torch.device
    budget_bytes: float | None
    module_init_args: Mapping[str, Any] | None
    data_init_args: Mapping[str, Any] | None
    seed: int
    target: Target | None
    precision: str | int
    headroom: float | None


@dataclass(frozen=True)
class RunOptions:
    """The shared keywords of a probe call with the defaults filled in (the probes' docstrings say what each means)."""

    warmup_steps: int = 1
    device: str | torch.device = "cpu"
    budget_bytes: float | None = None
    module_init_args: Mapping[str, Any] | None = None
    data_init_args: Mapping[str, Any] | None = None
    seed: int = 0
    target: Target | None = None
    precision: str | int = "32-true"
    headroom: float | None = None

    @classmethod
    def of(cls, function: str, options: Mapping[str, Any]) -> RunOptions:
        """The ``options`` given to ``function``, over the defaults.

        Raises:
            TypeError: a keyword that neither the function nor `ProbeOptions` knows (a typo, most often).
        """
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = [name for name in options if name not in known]
        if unknown:
            name = unknown[0]
            raise TypeError(
                f"`{function}()` got an unexpected keyword argument `{name}={options[name]!r}`."
                f" The keywords both probes share are {', '.join(f'`{k}`' for k in known)}; check the spelling."
            )
        return cls(**options)
