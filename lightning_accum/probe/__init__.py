"""The memory probe: measure, on the user's own model, whether gradient accumulation lowers peak memory or raises it.

The answer depends on the baseline (see "The memory question" in the design brief):

- against the full batch ``B`` in one pass, accumulating ``k`` micro-batches of ``b = B/k`` lowers the peak by about
  the activation memory of ``B - b`` samples;
- against the same micro-batch ``b`` without accumulation, it raises the peak by up to one gradient copy, because the
  gradient buffer is alive during every forward pass after the first;
- the micro-batch size, not ``k``, sets the activation memory.

`probe_memory` runs a few real training steps per configuration and measures the peak of live tensor storage with
`lightning_accum.memory.tracker.MemoryTracker`. It fits ``peak(b)`` on the accumulating configurations (``k >= 2``),
where the gradient buffer is alive during the forward pass: that is what the micro-batch planner faces. The fit's
error is checked by fitting the sizes at even positions of the sorted list and predicting the others, so both
interpolation and, when the largest size is held out, extrapolation are tested.

With ``device="meta"`` the same steps run on fake tensors (`lightning_accum.memory.fake.FakeTarget`): nothing is
allocated, so a model that doesn't fit the machine can be asked about, and the peaks are those the steps would reach
on ``target`` (``"cpu"``: the same bytes as a real CPU run; ``"cuda"``: ``torch.cuda.memory_allocated``, less what
fake tensors can't see). ``precision`` runs the steps as ``Trainer(precision=...)`` would.

The package's modules: ``resolve`` turns import paths, init args and LightningCLI configs into factories;
``measure`` runs the configurations; ``result`` holds what was measured; ``report`` turns it into sentences, a
table, JSON, a plot and a snippet to paste (``present`` does so for either kind of result: `findings`, `table`,
`to_dict`, `snippet`, `plot`, `write_outputs`); ``preflight`` fits ``peak(b)`` of a split-mode step from fake-tensor
traces, for a cold start without out-of-memory errors. ``tokens`` (with ``token_result`` and ``token_report``) is the
probe in tokens, for split mode by tokens: `probe_tokens` fits ``fixed + T (a + c L)`` at several sequence lengths
and answers with a ``micro_batch_tokens``.

Examples:
    >>> import lightning.pytorch as pl
    >>> class Tiny(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    ...     def training_step(self, batch, batch_idx):
    ...         return self.net(batch).square().mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> result = probe_memory(Tiny(), lambda b: torch.randn(b, 32), batch_size=32, accumulation_steps=[4],
    ...                       fit_micro_batch_sizes=[2, 4], steps=1)
    >>> full, acc, same = result.measurement(32, 1), result.measurement(8, 4), result.measurement(8, 1)
    >>> full.peak_bytes > acc.peak_bytes >= same.peak_bytes
    True
"""

import torch  # noqa: F401  (the example above uses it)

from lightning_accum.probe.measure import probe_memory
from lightning_accum.probe.present import findings, plot, snippet, table, to_dict, write_outputs
from lightning_accum.probe.resolve import import_object, load_cli_config
from lightning_accum.probe.result import ProbeMeasurement, ProbeResult
from lightning_accum.probe.token_result import TokenProbeResult
from lightning_accum.probe.tokens import probe_tokens

__all__ = [
    "ProbeMeasurement",
    "ProbeResult",
    "TokenProbeResult",
    "findings",
    "import_object",
    "load_cli_config",
    "probe_memory",
    "plot",
    "probe_tokens",
    "snippet",
    "table",
    "to_dict",
    "write_outputs",
]
