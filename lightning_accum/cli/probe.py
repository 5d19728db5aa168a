r"""``lightning-accum probe``: measure whether gradient accumulation lowers or raises peak memory on your model.

Examples::

    lightning-accum probe --model my_pkg.models:MyModel --init-args '{"width": 512}' \\
        --data my_pkg.data:MyDataModule --data-init-args '{"root": "data"}' \\
        --batch-size 64 --accumulation-steps 2 4 --max-memory 8GiB --output-dir probe_out
    lightning-accum probe --config config.yaml --batch-size 64 --device cuda
    lightning-accum probe --model examples.llama8b.model:LlamaLM --data examples.llama8b.model:random_tokens \\
        --batch-size 8 --accumulation-steps 8 --device meta --target cuda --precision bf16-true --json
    lightning-accum probe --model examples.llama8b.model:LlamaLM --data examples.llama8b.model:padded_tokens \\
        --data-init-args '{"seq_len": 4096}' --batch-size 8 --sequences --sequence-lengths 1024 2048 4096 \\
        --device meta --target cuda --precision bf16-true --max-memory 79GiB --steps 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

import lightning_accum
from lightning_accum.cli._common import CommandError, check_output_dir, int_at_least, memory_size, positive_float
from lightning_accum.memory.budget import GIB
from lightning_accum.memory.fake import TARGETS
from lightning_accum.memory.precision import PRECISIONS
from lightning_accum.probe import import_object, load_cli_config, present, probe_memory, write_outputs
from lightning_accum.probe.lightning_cli import build_with_cli
from lightning_accum.probe.resolve import check_init_args
from lightning_accum.probe.tokens import probe_tokens
from lightning_accum.sequences import PaddedSequences

# The probe's Python arguments -> this command's flags, so that its messages name what the user typed.
_FLAGS = {
    "module": "--model",
    "module_init_args": "--init-args",
    "data": "--data",
    "data_init_args": "--data-init-args",
    "config": "--config",
    "cli": "--cli",
    "batch_size": "--batch-size",
    "accumulation_steps": "--accumulation-steps",
    "fit_micro_batch_sizes": "--fit-micro-batch-sizes",
    "steps": "--steps",
    "warmup_steps": "--warmup-steps",
    "device": "--device",
    "target": "--target",
    "precision": "--precision",
    "sequences": "--sequences",
    "sequence_lengths": "--sequence-lengths",
    "sequence_dim": "--sequence-dim",
    "headroom": "--headroom",
}
_DEVICE_TYPES = ("cpu", "cuda", "meta")
_PACKAGE_DIR = Path(lightning_accum.__file__).resolve().parent
_TORCH_DIR = Path(torch.__file__).resolve().parent


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object like '{{\"width\": 512}}', got {text!r} ({err})"
        ) from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"width\": 512}}', got {text!r}")
    return value


HELP = "measure peak memory with and without gradient accumulation on your model"

DESCRIPTION = (
    "Run a few real training steps for the full batch B, for k micro-batches of B/k, and for B/k without "
    "accumulation; report the peak live tensor memory split into parameters, gradients, optimizer state and "
    "activations, fit peak(b), and say which micro-batch fits a budget."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``probe`` subcommand's arguments to its parser (`lightning_accum.cli.main` builds it); return it."""
    source = parser.add_argument_group("model and data (an import path with init args, or a LightningCLI config)")
    source.add_argument("--model", help="LightningModule import path, 'pkg.mod:Class'")
    source.add_argument(
        "--init-args", type=_json_object, default={}, help="JSON kwargs for --model; with --config, they override it"
    )
    source.add_argument(
        "--data", help="LightningDataModule, or a function (micro_batch_size, **kwargs) -> batch, as 'pkg.mod:Name'"
    )
    source.add_argument("--data-init-args", type=_json_object, default={}, help="JSON kwargs for --data")
    source.add_argument(
        "--config",
        help="a LightningCLI YAML config; its model/data sections give class_path and init_args, or only init_args "
        "for the classes named by --model/--data",
    )
    source.add_argument(
        "--cli",
        metavar="pkg.mod:MyCLI",
        help="with --config: your LightningCLI subclass; the probe builds the model and data through it, as `fit "
        "--config` would, so its link_arguments apply (e.g. data.vocab_size -> model.vocab_size)",
    )
    parser.add_argument(
        "--batch-size", type=int_at_least(1), help="the full batch B per device (default: the datamodule's)"
    )
    parser.add_argument(
        "--accumulation-steps",
        type=int_at_least(2),
        nargs="+",
        action="extend",
        help="accumulation steps k to compare, each dividing B; repeatable (default: 2 4)",
    )
    parser.add_argument(
        "--fit-micro-batch-sizes",
        type=int_at_least(1),
        nargs="+",
        help="micro-batch sizes for the peak(b) fit (default: B/2..B/16); with --sequences, the sequences per "
        "micro-batch measured at each length (default: B/8, B/4, B/2)",
    )
    _add_sequence_arguments(parser)
    _add_budget_arguments(parser)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N; or meta: predict on fake tensors, allocating nothing (default: cpu)",
    )
    parser.add_argument(
        "--target", choices=TARGETS, help="with --device meta: the device to predict for (default: cpu)"
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="32-true", help="as Trainer(precision=...) (default: 32-true)"
    )
    parser.add_argument(
        "--steps", type=int_at_least(1), default=2, help="measured optimizer steps per configuration (default: 2)"
    )
    parser.add_argument("--warmup-steps", type=int_at_least(0), default=1, help="unmeasured steps first (default: 1)")
    parser.add_argument("--output-dir", help="write probe.txt, probe.json and probe.png here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout, not the table")
    return parser


def _add_sequence_arguments(parser: argparse.ArgumentParser) -> None:
    tokens = parser.add_argument_group(
        "split by tokens (fit peak(T, L) against the padded tokens T of a micro-batch of sequences L long)"
    )
    tokens.add_argument(
        "--sequences",
        nargs="?",
        const="attention_mask",
        metavar="MASK|lengths=PATH",
        help="the batch holds right-padded sequences, as PaddedSequences reads them: the key of their 0/1 mask "
        "(alone: attention_mask; an int for a position in a tuple batch), or lengths=pkg.mod:fn; answers in "
        "micro_batch_tokens",
    )
    tokens.add_argument(
        "--sequence-lengths",
        type=int_at_least(1),
        nargs="+",
        metavar="L",
        help="with --sequences: the lengths to measure at, each at most what the data pads to (default: P/4 P/2 P "
        "of the data's padded length P); the token budget is for the longest",
    )
    tokens.add_argument(
        "--sequence-dim", type=int_at_least(1), default=1, help="with --sequences: the sequence's dim (default: 1)"
    )


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--max-memory",
        type=memory_size,
        help="a memory budget, as AutoMicroBatching(max_memory=) takes it: a size such as 8GiB; which micro-batch "
        "fits it?",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        help="the share of --max-memory kept free for what the probe cannot see (default: 0.1 with --target cuda, "
        "else 0)",
    )
    parser.add_argument(
        "--process-overhead",
        type=_process_overhead,
        default="measure",
        help="with --sequences on the CPU: what a training process holds beyond the probe's before any tensor (a "
        "Trainer, its loggers), kept free of --max-memory: 'measure' (default: a tiny model run in two fresh "
        "processes, under a Trainer and by hand, a few seconds), a size such as 64MiB, or 0",
    )
    # The older spelling of --max-memory, in GiB; kept so that existing scripts run.
    budget.add_argument("--budget-gib", type=positive_float, help=argparse.SUPPRESS)


def _process_overhead(text: str) -> int | str:
    """An ``argparse`` type: ``measure``, ``0``, or a size such as ``64MiB``."""
    if text in ("measure", "0"):
        return text if text == "measure" else 0
    try:
        return memory_size(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}; or 'measure', or 0 to keep nothing") from None


def run(args: argparse.Namespace) -> int:
    """Run the probe, print the table and write the files; return the exit status.

    Raises:
        CommandError: a mistake in the arguments, or in the model or data they name (found before measuring).
    """
    # Resolve import paths from the working directory, as `python -m` would: a console script does not add it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    device = _device(args.device)
    output_dir = None if args.output_dir is None else check_output_dir(args.output_dir, "--output-dir")
    try:
        result = _probe(args, device)
    except torch.OutOfMemoryError as err:
        first_line = next(iter(str(err).splitlines()), "") or "out of memory"
        raise CommandError(
            f"`--device`={args.device!r} ran out of memory during the probe ({first_line}). Lower `--batch-size`, or "
            "probe on a device with more memory."
        ) from err
    except (ImportError, FileNotFoundError, ValueError, TypeError, RuntimeError, IndexError) as err:
        # The probe's own checks of what it was given; an error raised inside the user's model keeps its traceback,
        # unless torch raised it on the data's batch: then the model and the data disagree (a config, not a bug).
        if _raised_by_lightning_accum(err) and not isinstance(err, IndexError):
            raise CommandError(_with_flags(str(err))) from err
        disagreement = _model_and_data_disagree(err, args)
        if disagreement is None:
            raise
        raise CommandError(disagreement) from err
    print(json.dumps(present.to_dict(result), indent=2) if args.json else present.table(result))
    if output_dir is not None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                paths = write_outputs(result, output_dir)
            for warning in caught:  # a picture left out is a warning, not a failure: the numbers are written
                print(f"warning: {warning.message}", file=sys.stderr)
        except OSError as err:
            raise CommandError(
                f"`--output-dir`={args.output_dir!r}: could not write the results: {err}. Choose a directory you can "
                "write to."
            ) from err
        wrote = "wrote " + ", ".join(str(p) for p in paths.values())
        if args.json:  # stdout stays pure JSON
            print(wrote, file=sys.stderr)
        else:
            print("\n" + wrote)
    return 0


def _probe(args: argparse.Namespace, device: str) -> Any:
    module, data, module_init_args, data_init_args = _sources(args)
    if data is None:
        raise CommandError("`--data` (an import path) or a `data` section in `--config` is needed.")
    if isinstance(data, str):
        data = import_object(data, "--data")
    if isinstance(data, type):  # a datamodule class: build it now so its batch size can be the default B
        check_init_args(data, data_init_args, "data_init_args")
        data, data_init_args = data(**data_init_args), {}
    batch_size = args.batch_size if args.batch_size is not None else getattr(data, "batch_size", None)
    if not isinstance(batch_size, int):
        raise CommandError("`--batch-size` is needed: the data has no int `batch_size` to default to.")
    sequences = _sequences(args)
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "fit_micro_batch_sizes": args.fit_micro_batch_sizes,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "device": device,
        "target": args.target,
        "precision": args.precision,
        "budget_bytes": _budget_bytes(args),
        "module_init_args": module_init_args,
        "data_init_args": data_init_args,
        "headroom": args.headroom,
    }
    if sequences is not None:
        return probe_tokens(
            module,
            data,
            sequences=sequences,
            sequence_lengths=args.sequence_lengths,
            process_overhead=args.process_overhead,
            **common,
        )
    return probe_memory(module, data, accumulation_steps=args.accumulation_steps or (2, 4), **common)


def _sources(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """The model and data the arguments name, and the init args still to apply to each."""
    if args.cli and not args.config:
        raise CommandError(f"`--cli`={args.cli!r} needs `--config`: the CLI builds the model and data from it.")
    if args.cli:
        module, data = build_with_cli(
            args.cli, [args.config], args.model, args.data, args.init_args, args.data_init_args
        )
        return module, data, {}, {}
    if args.config:
        # With a config, --model/--data name the classes of sections that carry only init args.
        make_module, make_data = load_cli_config(
            args.config, args.model, args.data, args.init_args, args.data_init_args
        )
        return make_module, None if make_data is None else make_data(), {}, {}
    if args.model:
        return args.model, args.data, dict(args.init_args), dict(args.data_init_args)
    raise CommandError("`--model` (an import path 'pkg.mod:Class') or `--config` (a LightningCLI YAML) is needed.")


def _sequences(args: argparse.Namespace) -> PaddedSequences | None:
    """The `PaddedSequences` that ``--sequences`` describes, or ``None`` (the probe in samples)."""
    text = args.sequences
    if text is None:
        for flag, given in (("--sequence-lengths", args.sequence_lengths), ("--sequence-dim", args.sequence_dim != 1)):
            if given:
                raise CommandError(
                    f"`{flag}` needs `--sequences`: it describes the sequences the probe in tokens cuts."
                )
        return None
    if args.accumulation_steps:
        raise CommandError(
            f"`--accumulation-steps` does not apply with `--sequences`: the probe in tokens measures steps of 2"
            f" micro-batches at every shape, and split mode by tokens sets k from the token budget. Drop"
            f" `--accumulation-steps {' '.join(map(str, args.accumulation_steps))}`."
        )
    key, value = text.split("=", 1) if "=" in text else ("mask", text)
    if key not in ("mask", "lengths") or not value:
        raise CommandError(
            f"`--sequences`={text!r} is not a mask key or `lengths=pkg.mod:fn`. Pass the key of the batch's 0/1"
            " mask (e.g. `--sequences attention_mask`), or `--sequences lengths=my_pkg.data:lengths`."
        )
    try:
        if key == "mask":
            return PaddedSequences(int(value) if value.isdigit() else value, sequence_dim=args.sequence_dim)
        return PaddedSequences(lengths=value, sequence_dim=args.sequence_dim)
    except (ImportError, TypeError, ValueError) as err:
        raise CommandError(f"`--sequences`={text!r}: {err}") from err


def _budget_bytes(args: argparse.Namespace) -> float | None:
    # `--budget-gib` parses as a float, `--max-memory` as a size in bytes (an int); both default to None.
    budget: float | None = args.max_memory if args.budget_gib is None else args.budget_gib * GIB
    return budget


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in _DEVICE_TYPES:
        raise CommandError(f"`--device`={text!r} is not a device the probe runs on: use cpu, cuda, cuda:N or meta.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else ", and this PyTorch is built without CUDA"
            raise CommandError(
                f"`--device`={text!r} but CUDA is not available here{build}. Use `--device cpu`, or run on a "
                "machine with a GPU."
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            devices = "1 CUDA device" if count == 1 else f"{count} CUDA devices"
            raise CommandError(
                f"`--device`={text!r} but there is only {devices} here. Use one of "
                + ", ".join(f"cuda:{i}" for i in range(count))
                + "."
            )
    return text


def _raised_by_lightning_accum(err: BaseException) -> bool:
    # Where the exception was raised: in this package (a check on what the user passed), or in the user's code.
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and _ours(frames[-1].filename)


def _model_and_data_disagree(err: BaseException, args: argparse.Namespace) -> str | None:
    """One line for an `IndexError` or `RuntimeError` that torch raised while the user's model ran on the batch."""
    frames = traceback.extract_tb(err.__traceback__)
    if not isinstance(err, (IndexError, RuntimeError)) or not frames or not _in_torch(frames[-1].filename):
        return None
    caller = next((f for f in reversed(frames) if not _in_torch(f.filename) and not _ours(f.filename)), frames[-1])
    first_line = next(iter(str(err).splitlines()), "")
    fix = (
        "check that the CLI's links and the config agree"
        if args.cli
        else "if your LightningCLI links them (link_arguments, e.g. data.vocab_size -> model.vocab_size), pass it "
        "with `--cli pkg.mod:YourCLI`; or set both to agree in `--config`/`--init-args`"
    )
    return (
        f"the model and the data disagree: the model failed on the data's first batch with {type(err).__name__}: "
        f"{first_line} (in {Path(caller.filename).name}:{caller.lineno}, {caller.name}), e.g. an id beyond the "
        f"model's vocabulary or a shape it does not take. To fix: {fix}."
    )


def _in_torch(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_TORCH_DIR)


def _ours(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_PACKAGE_DIR)


def _with_flags(message: str) -> str:
    return re.sub(r"`(\w+)`", lambda m: f"`{_FLAGS.get(m[1], m[1])}`", message)
