#!/usr/bin/env bash
# The GPU checks, as one prepared script for a session that is lent a GPU machine (see the device tool's README).
# Run from the repository root there:  bash examples/benchmarks/gpu_checks.sh
# It needs torch, lightning, torchmetrics, pytest and matplotlib, which that machine's image holds; W&B and
# jsonargparse are not needed. Results go to $OUT (or ./gpu_checks) for the issue notes and docs/memory.md.
set -uo pipefail
out="${OUT:-gpu_checks}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))" | tee "$out/device.txt"

# 1. Every GPU-marked test: 16-mixed with GradScaler (window and split mode), a real CUDA OOM recovered exactly,
#    the CUDA memory backend, the goodput objective's step timings on the device's own timeline (-s prints them).
#    addopts is cleared so that doctests of the W&B modules are not imported.
python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -s --timeout=600 \
    tests/callbacks tests/test_real_oom.py tests/memory tests/test_step_clock.py \
    tests/probe 2>&1 | tee "$out/gpu_tests.log"

# 2. The memory question on the GPU, on the example model (the table for docs/memory.md).
python3 -m lightning_accum.cli.main probe --model examples.char_lm.model:CharLM \
    --data examples.char_lm.data:CharLMDataModule --batch-size 32 --accumulation-steps 2 4 \
    --device cuda --output-dir "$out/probe_char_lm_cuda" 2>&1 | tee "$out/probe.log"
