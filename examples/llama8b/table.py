"""The 8B table of docs/memory.md: Llama-3-8B full fine-tuning in bf16 with AdamW, predicted on fake tensors.

    python -m examples.llama8b.table > table.md          # about 4 minutes on one CPU core; no GPU, no memory

For micro-batch 1 x 8 accumulation steps, 8 x 1, and 1 without accumulation, with activation checkpointing off and
on, it prints the predicted peak on a CUDA device (``lightning-accum probe --device meta --target cuda --precision
bf16-true``), split into parameters, gradients, optimizer state and activations, and the peaks of the
forward/backward passes and of the optimizer step. Then it checks the parameter, gradient and optimizer bytes against
the arithmetic: parameter count x bytes per element, and says which rows fit the GPUs in `GPUS` and by how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

from examples.llama8b.model import LLAMA3_8B, LlamaConfig, LlamaLM, random_tokens
from lightning_accum.probe import ProbeMeasurement, ProbeResult, probe_memory

KiB, MiB, GiB = 2**10, 2**20, 2**30
BLOCK = 512  # the CUDA caching allocator's block: AdamW's 4-byte `step` counters take one each


@dataclasses.dataclass(frozen=True)
class GPU:
    """What one GPU leaves a PyTorch process for its tensors.

    Attributes:
        name: as ``nvidia-smi`` names it.
        nvidia_smi_mib: ``memory.total`` in ``nvidia-smi``: the card's binary size (an "80 GB" card is 80 GiB or less).
        pytorch_gib: ``torch.cuda.mem_get_info()[1]``, the "total capacity" of PyTorch's out-of-memory message: less
            than ``nvidia-smi`` says, by what the driver keeps for itself.
        cublas_workspace_bytes: one cuBLAS workspace per stream, allocated through PyTorch's caching allocator (so
            ``memory_allocated`` counts it and fake tensors do not): ``CUBLAS_WORKSPACE_CONFIG``'s default, 32 MiB from
            Hopper on and ``:4096:2:16:8`` before (pytorch/pytorch#89027, #120925).
    """

    name: str
    nvidia_smi_mib: int
    pytorch_gib: float
    cublas_workspace_bytes: int

    @property
    def unseen_bytes(self) -> int:
        """What the device holds outside the prediction: the CUDA context, a cuBLAS and a cuBLASLt workspace."""
        return CUDA_CONTEXT_BYTES + 2 * self.cublas_workspace_bytes  # Lt may share cuBLAS's; count both (#145130)

    @property
    def left_bytes(self) -> float:
        """Bytes left for the predicted tensors (and the allocator's fragmentation)."""
        return self.pytorch_gib * GiB - self.unseen_bytes


# The PyTorch totals are the "total capacity" of posted out-of-memory messages: A100 80GB 79.15 GiB (next to an
# nvidia-smi total of 81920MiB), H100 80GB HBM3 79.18 GiB (one GPU; 79.21 on eight), H200 139.80 GiB. nvidia-smi's
# totals: NVIDIA's "80GB" and "141GB" datasheet sizes are decimal; the cards report 81920, 81559 and 143771 MiB.
GPUS = (
    GPU("A100 80GB", 81_920, 79.15, 2 * 4096 * KiB + 8 * 16 * KiB),
    GPU("H100 80GB HBM3", 81_559, 79.18, 32 * MiB),
    GPU("H200", 143_771, 139.80, 32 * MiB),
)
CUDA_CONTEXT_BYTES = 512 * MiB
"""The CUDA context of one process: about 300 MB since CUDA 11.7 loads kernels lazily (pytorch/pytorch#107667); a
posted H100 OOM message shows 0.48 GiB of non-PyTorch memory in the process (79.23 in use, 78.75 reserved)."""


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


def gpu_rows(gpus: Sequence[GPU] = GPUS) -> list[str]:
    """The markdown rows of what each GPU in ``gpus`` leaves for tensors."""
    out = [
        "| GPU | nvidia-smi | PyTorch's total | CUDA context | cuBLAS + cuBLASLt workspaces | left for tensors |",
        "|---|---|---|---|---|---|",
    ]
    for gpu in gpus:
        out.append(
            f"| {gpu.name} | {gpu.nvidia_smi_mib:,} MiB ({gpu.nvidia_smi_mib * MiB / GiB:.2f} GiB) "
            f"| {gpu.pytorch_gib:.2f} GiB | {CUDA_CONTEXT_BYTES / GiB:.2f} GiB "
            f"| {2 * gpu.cublas_workspace_bytes / MiB:.2f} MiB | **{gpu.left_bytes / GiB:.2f} GiB** |"
        )
    return out


def fits(peak_bytes: float, gpu: GPU) -> str:
    """``"fits, 2.78 GiB to spare"`` or ``"94.30 GiB short"``: the predicted peak against what ``gpu`` leaves."""
    spare = gpu.left_bytes - peak_bytes
    return f"fits, {spare / GiB:.2f} GiB to spare" if spare >= 0 else f"{-spare / GiB:.2f} GiB short"


def fit_rows(results: dict[bool, ProbeResult], gpus: Sequence[GPU] = GPUS) -> list[str]:
    """The markdown rows of which configurations fit which GPU, and by how much."""
    out = [
        "| micro-batch x GA | checkpointing | peak (GiB) | " + " | ".join(gpu.name for gpu in gpus) + " |",
        "|---|---|---|" + "---|" * len(gpus),
    ]
    for checkpointing, result in results.items():
        for b, k in ((1, 8), (8, 1), (1, 1)):
            m = result.measurement(b, k)
            out.append(
                f"| {b} x {k}{' (no accumulation)' if (b, k) == (1, 1) else ''} | {'on' if checkpointing else 'off'} "
                f"| {m.peak_bytes / GiB:.2f} | " + " | ".join(fits(m.peak_bytes, gpu) for gpu in gpus) + " |"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers, help="decoder layers (default: 32)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    args = parser.parse_args(argv)
    results = {checkpointing: predict(args.layers, args.seq_len, checkpointing) for checkpointing in (False, True)}
    checks = cross_check(results[False].measurement(1, 8), args.layers)
    print("\n".join([*rows(results), "", *checks, "", *gpu_rows(), "", *fit_rows(results)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
