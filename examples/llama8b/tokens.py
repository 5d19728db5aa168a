"""The 8B in tokens (docs/language-models.md): Llama-3-8B full fine-tuning in bf16 with AdamW, by padded tokens.

    python -m examples.llama8b.tokens > tokens.md    # about 12 minutes on one CPU core; no GPU, no memory

For micro-batches of 1, 2 and 4 sequences of 1024, 2048 and 4096 tokens, the probe in tokens predicts the peak on a
CUDA device on fake tensors (``lightning-accum probe --sequences --device meta --target cuda --precision
bf16-true``) and fits ``peak = fixed + T (a + c L)``: with attention through ``F.scaled_dot_product_attention``
(activation checkpointing off, then on) and with eager attention. Then it prints the token budget that fits each GPU
of `examples.llama8b.table.GPUS` (what the card leaves for tensors, as the 8B table of docs/memory.md counts it); the
step batch of the starting question (8 sequences, micro-batch 1 x 8) at each length, by samples and by tokens; and
what a skewed length distribution costs each way in padded positions, passes and compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Sequence

import torch

from examples.llama8b.model import LLAMA3_8B, LlamaConfig, LlamaLM, log_normal_lengths, padded_tokens
from examples.llama8b.table import GPU, GPUS, GiB, MiB
from lightning_accum.probe.token_report import percent
from lightning_accum.probe.token_result import TokenProbeResult
from lightning_accum.probe.tokens import probe_tokens
from lightning_accum.sequences.token_cut import TokenCut

LENGTHS = (1024, 2048, 4096)
SIZES = (1, 2, 4)
STEP_BATCH = 8  # the starting question: micro-batch 1 x 8 accumulation steps
VARIANTS = {  # name -> (activation checkpointing, attention)
    "SDPA": (False, "sdpa"),
    "SDPA, checkpointing": (True, "sdpa"),
    "eager": (False, "eager"),
}


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A skewed length distribution: log-normal around ``median`` (``sigma`` the spread of its log), clamped."""

    median: int = 512
    sigma: float = 0.8
    shortest: int = 16
    longest: int = 2048

    def draw(self, count: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return log_normal_lengths(count, self.median, self.sigma, self.shortest, self.longest, g).tolist()


def probe_8b(config: LlamaConfig, checkpointing: bool, attention: str, lengths=LENGTHS, sizes=SIZES):
    """The probe in tokens on fake tensors for CUDA, in bf16-true: micro-batches of ``sizes`` x ``lengths``."""
    return probe_tokens(
        functools.partial(LlamaLM, config, activation_checkpointing=checkpointing, attention=attention),
        functools.partial(padded_tokens, seq_len=max(lengths), vocab_size=config.vocab_size),
        batch_size=STEP_BATCH,
        sequence_lengths=lengths,
        fit_micro_batch_sizes=sizes,
        steps=1,
        device="meta",
        target="cuda",
        precision="bf16-true",
    )


def on_gpu(result: TokenProbeResult, gpu: GPU) -> TokenProbeResult:
    """``result`` with the budget ``gpu`` leaves for tensors, with nothing more kept free (it counts the unseen)."""
    return dataclasses.replace(result, budget_bytes=gpu.left_bytes, headroom=0.0)


def fit_rows(results: dict[str, TokenProbeResult]) -> list[str]:
    """The fitted coefficients, the optimizer step and the held-out errors, one row per variant."""
    per = " / ".join(str(n) for n in LENGTHS)
    out = [
        f"| attention | fixed (GiB) | a, per token (MiB) | c, per token and position (B) | per token at {per} (MiB) "
        "| optimizer step (GiB) | held-out error | a fit in T alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        fixed, a, c = r.coefficients
        at = " / ".join(f"{(a + c * n) / MiB:.2f}" for n in LENGTHS)
        out.append(
            f"| {name} | {fixed / GiB:.2f} | {a / MiB:.3f} | {c:,.2f} | {at} | {r.optimizer_peak_bytes / GiB:.2f} "
            f"| {percent(r.holdout_error or 0.0)} | {percent(r.tokens_only_holdout_error or 0.0)} |"
        )
    return out


def peak_rows(result: TokenProbeResult) -> list[str]:
    """The predicted peaks of every shape measured, against the fit."""
    out = ["| L | n | T | peak (GiB) | passes (GiB) | fit (GiB) | shape |", "|---|---|---|---|---|---|---|"]
    held = set(result.holdout_shapes)
    for m in result.measurements:
        fit = result.passes_bytes(m.tokens, m.length)
        out.append(
            f"| {m.length} | {m.samples} | {m.tokens} | {m.peak_bytes / GiB:.2f} | {m.passes_peak_bytes / GiB:.2f} "
            f"| {fit / GiB:.2f} | {'held out' if (m.tokens, m.length) in held else 'fitted'} |"
        )
    return out


def _fits_text(result: TokenProbeResult, length: int) -> str:
    tokens = result.fitting_tokens_at(length)
    return "none" if tokens is None else f"{tokens:,} ({tokens // length})"


def budget_rows(results: dict[str, TokenProbeResult], gpus: Sequence[GPU] = GPUS) -> list[str]:
    """The token budget that fits each GPU at each length (sequences per micro-batch), and the longest alone."""
    out = [
        "| attention | GPU | left for tensors (GiB) | "
        + " | ".join(f"micro_batch_tokens at L={n}" for n in LENGTHS)
        + " | longest sequence alone |",
        "|---|---|---|" + "---|" * (len(LENGTHS) + 1),
    ]
    for name, result in results.items():
        for gpu in gpus:
            r = on_gpu(result, gpu)
            longest = r.longest_alone()
            out.append(
                f"| {name} | {gpu.name} | {gpu.left_bytes / GiB:.2f} | "
                + " | ".join(_fits_text(r, n) for n in LENGTHS)
                + f" | {'none' if longest is None else f'{longest:,}'} |"
            )
    return out


def step_rows(result: TokenProbeResult, gpu: GPU) -> list[str]:
    """The step batch of 8 sequences of one length: micro-batch 1 x 8, and by tokens at the budget that fits."""
    r = on_gpu(result, gpu)
    out = [
        "| sequences | 1 x 8: peak (GiB) | fits | by tokens: micro_batch_tokens | micro-batches | peak (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for length in LENGTHS:
        one = r.predict(length, length)
        tokens = r.fitting_tokens_at(length)
        spare = gpu.left_bytes - one
        fits = f"yes, {spare / GiB:.2f} GiB to spare" if spare >= 0 else f"no, {-spare / GiB:.2f} GiB short"
        if tokens is None:
            by_tokens = "none fits | | "
        else:
            n = tokens // length
            by_tokens = f"{tokens:,} | {math.ceil(STEP_BATCH / n)} of {n} | {r.predict(n * length, length) / GiB:.2f}"
        out.append(f"| 8 x {length} | {one / GiB:.2f} | {fits} | {by_tokens} |")
    return out


def step_flops(groups: Sequence[tuple[int, int]], config: LlamaConfig = LLAMA3_8B) -> float:
    """Training FLOPs of micro-batches of ``(sequences, length)``: matmuls 6 N T, causal attention 6 l d n L²."""
    matmul = config.parameter_count() - config.vocab_size * config.hidden_size  # the embedding is a lookup
    return sum(
        6 * matmul * n * length + 6 * config.num_layers * config.hidden_size * n * length**2 for n, length in groups
    )


def distribution_rows(
    result: TokenProbeResult, gpu: GPU, lengths: Lengths, config: LlamaConfig = LLAMA3_8B, steps: int = 512
) -> list[str]:
    """``steps`` step batches of 8 drawn from ``lengths``, run three ways: per step, on average."""
    r = on_gpu(result, gpu)
    budget = r.fitting_tokens_at(lengths.longest)
    drawn = lengths.draw(steps * STEP_BATCH)
    ways = {"split by samples, 1 x 8 (padded to the step's longest)": [], "window mode, micro-batch 1 x 8": []}
    ways[f"split by tokens, micro_batch_tokens={budget:,}"] = []
    for s in range(steps):
        batch = sorted(drawn[s * STEP_BATCH : (s + 1) * STEP_BATCH], reverse=True)
        cut = TokenCut(None, list(range(STEP_BATCH)), batch, batch[0], 1)
        by_tokens = [(len(g), batch[g.start]) for g in cut.groups(budget)]
        for way, groups in zip(ways.values(), ([(1, batch[0])] * 8, [(1, n) for n in batch], by_tokens), strict=True):
            way.append(groups)
    real = sum(drawn) / steps
    out = [
        "| step batch of 8 | micro-batches | positions computed | padding | compute (TFLOP) | largest micro-batch "
        "(tokens) | its peak (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, runs in ways.items():
        positions = sum(n * length for groups in runs for n, length in groups) / steps
        largest = max(max(n * length for n, length in groups) for groups in runs)
        length = max(length for groups in runs for n, length in groups if n * length == largest)
        flops = sum(step_flops(groups, config) for groups in runs) / steps
        out.append(
            f"| {way} | {sum(map(len, runs)) / steps:.2f} | {positions:,.0f} | {1 - real / positions:.1%} "
            f"| {flops / 1e12:.1f} | {largest:,} | {r.predict(largest, length) / GiB:.2f} |"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers, help="decoder layers (default: 32)")
    args = parser.parse_args(argv)
    config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    results = {name: probe_8b(config, *variant) for name, variant in VARIANTS.items()}
    h100 = GPUS[1]
    sections = [
        fit_rows(results),
        peak_rows(results["SDPA"]),
        budget_rows(results),
        step_rows(results["SDPA"], h100),
        step_rows(results["SDPA, checkpointing"], h100),
        distribution_rows(results["SDPA"], h100, Lengths(), config),
    ]
    print("\n\n".join("\n".join(rows) for rows in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
