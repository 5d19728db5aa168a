"""The Llama-3-8B-shaped example: built on the meta device at the published size, and traced at its real width."""

from __future__ import annotations

import dataclasses

import torch

from examples.llama8b.model import LLAMA3_8B, TINY, LlamaLM
from examples.llama8b.table import cross_check, probe_on_meta


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
