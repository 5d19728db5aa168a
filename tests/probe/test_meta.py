"""``probe_memory(device="meta")``: predicted peaks agree with the measured live-tensor peaks, allocating nothing.

The two example models sit at opposite ends: the byte-level LM (activation-heavy; tied embeddings and causal
attention, the two things the old ``.to("meta")`` probe got wrong: +11 to +21 %), and the Llama-shaped miniature
(parameter-heavy: a large tied vocabulary, AdamW; +25 to +51 % before).
"""

from __future__ import annotations

import pytest
import torch

from examples.char_lm.data import CharLMDataModule
from examples.char_lm.model import CharLM
from examples.llama8b.model import TINY, LlamaLM, tiny_tokens
from lightning_accum.probe import ProbeResult, present, probe_memory
from tests.probe.models import ActHeavy, _Stack, regression_batch

CHAR_LM = {"max_length": 128, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _char_lm_data() -> CharLMDataModule:
    return CharLMDataModule(batch_size=8, min_length=64, max_length=128, max_sequences=200)


def _relative_errors(module, data, **kwargs) -> tuple[dict[str, float], ProbeResult]:
    real = probe_memory(module, data, device="cpu", **kwargs)
    meta = probe_memory(module, data, device="meta", **kwargs)
    assert meta.parameter_bytes == real.parameter_bytes  # tied weights stay tied
    errors = {}
    for measured, predicted in zip(real.measurements, meta.measurements, strict=True):
        errors[measured.label] = predicted.peak_bytes / measured.peak_bytes - 1
    print({label: f"{error:+.3%}" for label, error in errors.items()})
    return errors, real


@pytest.mark.parametrize(
    ("module", "data"),
    [
        pytest.param(lambda: CharLM(**CHAR_LM), _char_lm_data, id="char_lm-activation-heavy"),
        pytest.param(lambda: LlamaLM(TINY), lambda: tiny_tokens, id="llama_tiny-parameter-heavy"),
    ],
)
def test_meta_agrees_with_the_measured_peak_within_5_percent(module, data):
    kwargs = {"batch_size": 8, "accumulation_steps": (2,), "fit_micro_batch_sizes": (), "steps": 1}
    errors, _ = _relative_errors(module, data(), **kwargs)
    assert all(abs(error) <= 0.05 for error in errors.values()), errors


def _small(optimizer: str = "sgd") -> _Stack:
    return _Stack(width=64, depth=4, optimizer=optimizer)


@pytest.mark.parametrize(("precision", "parameter_bytes"), [("bf16-mixed", 4), ("bf16-true", 2)])
def test_meta_follows_the_precision_as_the_real_run_does(precision, parameter_bytes):
    kwargs = {"batch_size": 16, "accumulation_steps": (2,), "fit_micro_batch_sizes": (), "steps": 1}
    errors, real = _relative_errors(_small, regression_batch, precision=precision, **kwargs)
    assert all(abs(error) <= 0.05 for error in errors.values()), errors
    # bf16-true converts the weights (2 bytes each); bf16-mixed keeps them in float32 and autocasts the forward.
    assert real.parameter_bytes == parameter_bytes * 4 * (64 * 64 + 64)


def test_cuda_target_counts_allocator_blocks_and_the_foreach_optimizer():
    kwargs = {"batch_size": 2, "accumulation_steps": (2,), "fit_micro_batch_sizes": (), "steps": 1, "device": "meta"}
    make = lambda: _small(optimizer="adam")  # noqa: E731
    cpu = probe_memory(make, regression_batch, target="cpu", **kwargs).measurement(2, 1)
    cuda = probe_memory(make, regression_batch, target="cuda", **kwargs).measurement(2, 1)
    # 4 weights of 64 x 64 floats (16 KiB: whole 512-byte blocks already) and 4 biases of 256 bytes, each counted
    # as one block; Adam's state likewise (2 buffers per parameter), and its 8 step counters of 4 bytes.
    assert cuda.breakdown["parameters"] - cpu.breakdown["parameters"] == 4 * (512 - 256)
    assert cuda.breakdown["optimizer_state"] - cpu.breakdown["optimizer_state"] == 2 * 4 * (512 - 256) + 8 * 508
    # The CPU loop holds one parameter's temporaries at a time; CUDA's default foreach Adam holds them for all
    # 8 at once (its sqrt of exp_avg_sq: one more copy of the parameters, less the one the loop holds too).
    weights = 4 * 4 * (64 * 64 + 64)
    extra = cuda.phase_peak_bytes["optimizer"] - cpu.phase_peak_bytes["optimizer"]
    assert 0.5 * weights < extra < 1.5 * weights, (extra, weights)


def test_target_applies_only_to_meta():
    with pytest.raises(ValueError, match=r"`target`='cuda' only applies with `device`='meta'"):
        probe_memory(ActHeavy, regression_batch, batch_size=4, device="cpu", target="cuda")
    with pytest.raises(ValueError, match=r"`target` must be one of cpu, cuda, got 'tpu'"):
        probe_memory(ActHeavy, regression_batch, batch_size=4, device="meta", target="tpu")
    with pytest.raises(ValueError, match=r"`precision` must be one of .*got 'fp8'"):
        probe_memory(ActHeavy, regression_batch, batch_size=4, precision="fp8")


def test_meta_result_says_it_is_a_prediction():
    result = probe_memory(
        _small, regression_batch, batch_size=4, accumulation_steps=(2,), fit_micro_batch_sizes=(1,), device="meta",
        target="cuda", precision="bf16-true", steps=1, budget_bytes=2**20,
    )  # fmt: skip
    assert (result.device, result.target, result.precision, result.headroom) == (
        "meta (as cuda)",
        "cuda",
        "bf16-true",
        0.1,
    )
    table = present.table(result)
    assert table.startswith("Predicted peak live tensor memory in KiB on meta (as cuda), bf16-true")
    assert "Not seen: the CUDA context" in table and "keeping 10% of it free" in table
    assert present.to_dict(result)["target"] == "cuda"
    assert isinstance(torch.empty(0), torch.Tensor)  # fake mode was left: tensors are real again
