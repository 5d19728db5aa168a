"""The Llama-3-8B-shaped example: built on the meta device at the published size, and traced at its real width."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.llama8b.model import LLAMA3_8B, TINY, LlamaLM
from examples.llama8b.table import GPUS, GiB, KiB, MiB, cross_check, fits, gpu_rows, probe_on_meta
from examples.llama8b.tokens import Lengths, distribution_rows, on_gpu, probe_8b, step_flops


def test_8b_builds_on_meta_with_the_published_parameter_count():
    with torch.device("meta"):
        model = LlamaLM()
    params = list(model.parameters())
    # meta-llama/Meta-Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocabulary 128256
    assert sum(p.numel() for p in params) == LLAMA3_8B.parameter_count() == 8_030_261_248
    assert len(params) == 3 + 9 * 32 and all(p.is_meta for p in params)
    with torch.device("meta"):  # any depth: nothing is allocated, so 80 layers build as fast
        deep = LlamaLM(dataclasses.replace(LLAMA3_8B, num_layers=80))
    assert sum(p.numel() for p in deep.parameters()) == 8_030_261_248 + 48 * 218_112_000


def test_tied_miniature_counts_its_embedding_once():
    model = LlamaLM(TINY)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == TINY.parameter_count()


def test_a_traced_8b_layer_matches_the_parameter_arithmetic():
    # One decoder layer at the 8B's width and vocabulary, in bf16 with AdamW, predicted for CUDA on fake tensors.
    config = dataclasses.replace(LLAMA3_8B, num_layers=1)
    result = probe_on_meta(config, seq_len=16, batch_size=2)
    checks = cross_check(result.measurement(1, 2), layers=1)
    assert all(row.endswith("| yes |") for row in checks[2:]), "\n".join(checks)
    assert result.parameter_bytes == 2 * config.parameter_count()


def test_what_an_80_gb_card_leaves_for_tensors():
    # The cards' binary sizes as nvidia-smi reports them, not the datasheets' decimal "80 GB" (74.5 GiB) and "141 GB".
    sizes = {gpu.name: round(gpu.nvidia_smi_mib * MiB / GiB, 2) for gpu in GPUS}
    assert sizes == {"A100 80GB": 80.0, "H100 80GB HBM3": 79.65, "H200": 140.4}
    a100, h100, h200 = GPUS
    # What PyTorch sees, less the CUDA context (0.5 GiB) and a cuBLAS and a cuBLASLt workspace (32 MiB each on Hopper).
    assert h100.left_bytes == 79.18 * GiB - 512 * MiB - 64 * MiB
    assert a100.left_bytes == 79.15 * GiB - 512 * MiB - 2 * (8 * MiB + 128 * KiB)
    # The 8B's peaks (docs/memory.md): 74.79 and 75.84 GiB fit both 80 GB cards; 172.92 GiB fits none of them.
    assert fits(74.79 * GiB, h100) == "fits, 3.83 GiB to spare" and fits(75.84 * GiB, a100) == "fits, 2.79 GiB to spare"
    assert fits(172.92 * GiB, h200) == "33.68 GiB short"
    assert [row.count("**") for row in gpu_rows()[2:]] == [2, 2, 2]


def test_the_8b_in_tokens_separates_eager_attention_from_the_per_token_cost():
    # One decoder layer at the 8B's width, heads and vocabulary, in bf16 with AdamW, predicted for CUDA.
    config = dataclasses.replace(LLAMA3_8B, num_layers=1)
    lengths, sizes = (16, 32, 64), (1, 2, 4)
    sdpa = probe_8b(config, False, "sdpa", lengths, sizes)
    eager = probe_8b(config, False, "eager", lengths, sizes)
    # Eager attention keeps, per head and pair of positions, the float32 softmax and its bf16 copy: 4 + 2 bytes (and
    # a causal mask of 1 byte per pair that the micro-batch's sequences share, which the fit spreads over them).
    assert eager.coefficients[2] == pytest.approx(6 * config.num_heads * config.num_layers, rel=0.05)
    _, a, c = sdpa.coefficients
    assert c * 64 < 1e-3 * a  # the fused kernel keeps a log-sum-exp per query, not L scores
    torch.testing.assert_close(eager.coefficients[1], sdpa.coefficients[1], rtol=0.02, atol=0)
    assert eager.holdout_error < 0.01 and sdpa.holdout_error < 0.01
    assert eager.tokens_only_holdout_error > 10 * eager.holdout_error
    # The fixed part: the weights, their gradients and AdamW's two moments in bf16, 8 bytes per parameter; and where
    # the peak is at the start of the backward pass (one layer), the output layer's new gradient before it is added.
    head = 2 * config.vocab_size * config.hidden_size
    assert 8 * config.parameter_count() <= sdpa.coefficients[0] <= 8 * config.parameter_count() + 1.01 * head
    h100 = on_gpu(sdpa, GPUS[1])
    assert h100.budget_bytes == GPUS[1].left_bytes and h100.headroom == 0.0


def test_the_step_batch_of_eight_three_ways():
    result = probe_8b(dataclasses.replace(LLAMA3_8B, num_layers=1), False, "sdpa", (16, 32), (1, 2))
    rows = distribution_rows(result, GPUS[1], Lengths(median=12, shortest=2, longest=32), steps=16)
    by_samples, window, by_tokens = (row.split(" | ") for row in rows[2:])
    assert window[3] == "0.0%" and float(by_samples[3].rstrip("%")) > 0  # a micro-batch of one has no padding
    assert (by_samples[1], window[1]) == ("8.00", "8.00")
    assert float(by_tokens[1]) <= 8
    # Matmuls: 6 x (parameters less the embedding) per token; causal attention: 6 x layers x width per token pair.
    config = LLAMA3_8B
    matmul = config.parameter_count() - config.vocab_size * config.hidden_size
    assert step_flops([(2, 100)]) == 6 * matmul * 200 + 6 * 32 * 4096 * 2 * 100**2
