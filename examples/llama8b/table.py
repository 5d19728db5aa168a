"""The 8B table of docs/memory.md: Llama-3-8B full fine-tuning in bf16 with AdamW, predicted on fake tensors.

    python -m examples.llama8b.table > table.md          # about 4 minutes on one CPU core; no GPU, no memory

For micro-batch 1 x 8 accumulation steps, 8 x 1, and 1 without accumulation, with activation checkpointing off and
on, it prints the predicted peak on a CUDA device (``lightning-accum probe --device meta --target cuda --precision
bf16-true``), split into parameters, gradients, optimizer state and activations, and the peaks of the
forward/backward passes and of the optimizer step. Then it checks the parameter, gradient and optimizer bytes against
the arithmetic: parameter count x bytes per element.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

from examples.llama8b.model import LLAMA3_8B, LlamaConfig, LlamaLM, random_tokens
from lightning_accum.probe import ProbeMeasurement, ProbeResult, probe_memory

GiB = 2**30
BLOCK = 512  # the CUDA caching allocator's block: AdamW's 4-byte `step` counters take one each


def predict(layers: int, seq_len: int, checkpointing: bool) -> ProbeResult:
    """Probe the 8B shape (with ``layers`` decoder layers) on fake tensors: B = 8 as 1 x 8, 8 x 1 and 1 x 1."""
    return probe_on_meta(dataclasses.replace(LLAMA3_8B, num_layers=layers), seq_len, 8, checkpointing)


def probe_on_meta(config: LlamaConfig, seq_len: int, batch_size: int, checkpointing: bool = False) -> ProbeResult:
    """One bf16 step of ``config`` predicted for CUDA on fake tensors: B as 1 x B, B x 1 and 1 x 1."""
    return probe_memory(
        functools.partial(LlamaLM, config, activation_checkpointing=checkpointing),
        functools.partial(random_tokens, seq_len=seq_len, vocab_size=config.vocab_size),
        batch_size=batch_size,
        accumulation_steps=(batch_size,),
        fit_micro_batch_sizes=(),
        steps=1,
        device="meta",
        target="cuda",
        precision="bf16-true",
    )


def rows(results: dict[bool, ProbeResult]) -> list[str]:
    """The markdown rows of the peak table."""
    out = [
        "| micro-batch x GA | checkpointing | peak (GiB) | set in | parameters | gradients | optimizer state "
        "| activations | fwd/bwd peak | optimizer-step peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for checkpointing, result in results.items():
        for b, k in ((1, 8), (8, 1), (1, 1)):
            m = result.measurement(b, k)
            parts = [m.breakdown[c] / GiB for c in ("parameters", "gradients", "optimizer_state", "activations")]
            passes = max(m.phase_peak_bytes.get("forward", 0), m.phase_peak_bytes.get("backward", 0))
            out.append(
                f"| {b} x {k}{' (no accumulation)' if (b, k) == (1, 1) else ''} | {'on' if checkpointing else 'off'} "
                f"| **{m.peak_bytes / GiB:.2f}** | {m.peak_phase.split()[0]} | "
                + " | ".join(f"{p:.2f}" for p in parts)
                + f" | {passes / GiB:.2f} | {m.phase_peak_bytes.get('optimizer', 0) / GiB:.2f} |"
            )
    return out


def cross_check(m: ProbeMeasurement, layers: int) -> list[str]:
    """Parameter, gradient and optimizer bytes of one configuration against parameter count x bytes per element."""
    config = dataclasses.replace(LLAMA3_8B, num_layers=layers)
    count, tensors = config.parameter_count(), 3 + 9 * layers  # embeddings, head, final norm; 9 tensors per layer
    expected = {
        "parameters": (f"{count:,} x 2 B (bf16)", 2 * count),
        "gradients": (f"{count:,} x 2 B", 2 * count),
        "optimizer_state": (f"2 x {count:,} x 2 B (exp_avg, exp_avg_sq) + {tensors} x {BLOCK} B (step)", None),
    }
    expected["optimizer_state"] = (expected["optimizer_state"][0], 4 * count + tensors * BLOCK)
    out = ["| | arithmetic | bytes | probe (bytes) | match |", "|---|---|---|---|---|"]
    for category, (formula, value) in expected.items():
        got = m.breakdown[category]
        out.append(f"| {category} | {formula} | {value:,} | {got:,} | {'yes' if got == value else 'NO'} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers, help="decoder layers (default: 32)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    args = parser.parse_args(argv)
    results = {checkpointing: predict(args.layers, args.seq_len, checkpointing) for checkpointing in (False, True)}
    print("\n".join([*rows(results), "", *cross_check(results[False].measurement(1, 8), args.layers)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
