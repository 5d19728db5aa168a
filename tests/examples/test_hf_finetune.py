"""The Hugging Face fine-tuning example: its data, its model, one exact step, and a real 2-rank run from its YAML.

The run is the command a user types (``python -m examples.hf_finetune.main fit --config ...``), on 2 CPU ranks under
Lightning's ``ddp`` (which re-runs the command for rank 1), with W&B offline; what it wrote is read back from disk.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download; set before transformers is imported

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

import tests.helpers as h

pytest.importorskip("transformers", reason="the `hf` extra (transformers) is not installed")

from examples.hf_finetune.data import IGNORE_INDEX, InstructionPairs, collate_right_padded
from examples.hf_finetune.main import main
from examples.hf_finetune.model import HFCausalLM
from lightning_accum import AutoMicroBatching, keys

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "hf_finetune" / "configs" / "ddp_cpu.yaml"
RUN_TIMEOUT_S = 420  # the whole 2-rank run, under the test's own timeout so that the cleanup below always runs
STEPS = 3


class SaveRankParameters(pl.Callback):
    """Saves this rank's parameters at the start and at the end of fit (the run adds it from the command line)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        state = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(state, self.dirpath / f"{when}_rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, "end")


# ---------------------------------------------------------------------------------------------------------------
# data and model
# ---------------------------------------------------------------------------------------------------------------
def test_pairs_are_seeded_masked_and_of_varied_lengths() -> None:
    first, again, other = (InstructionPairs(200, 256, 128, seed=s) for s in (0, 0, 1))
    assert [s["input_ids"].tolist() for s in first] == [s["input_ids"].tolist() for s in again]
    assert [s["input_ids"].tolist() for s in first] != [s["input_ids"].tolist() for s in other]
    lengths = [len(s["input_ids"]) for s in first]
    assert max(lengths) <= 128 and len(set(lengths)) > 30 and max(lengths) > 3 * min(lengths)
    for sample in first:
        ids, labels = sample["input_ids"], sample["labels"]
        prompt = int((labels == IGNORE_INDEX).sum())  # the prompt and its separator carry no loss, the rest all does
        assert bool((labels[:prompt] == IGNORE_INDEX).all()) and torch.equal(labels[prompt:], ids[prompt:])
        assert 2 <= prompt < len(ids) - 1


def test_collate_pads_right_with_mask_and_ignored_labels() -> None:
    samples = list(InstructionPairs(6, 256, 128, seed=3))
    batch = collate_right_padded(samples)
    width = max(len(s["input_ids"]) for s in samples)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (6, width)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert torch.equal(batch["labels"][row, :n], sample["labels"])
        assert bool((batch["labels"][row, n:] == IGNORE_INDEX).all())


def test_checkpoint_loads_a_saved_model_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    built = HFCausalLM(vocab_size=64, n_positions=32, n_layer=1, n_embd=16, n_head=2)
    assert built.model.config.resid_pdrop == built.model.config.embd_pdrop == built.model.config.attn_pdrop == 0.0
    built.model.save_pretrained(tmp_path / "saved")
    loaded = HFCausalLM(vocab_size=64, n_positions=32, checkpoint=str(tmp_path / "saved"))
    for (name, param), (_, again) in zip(built.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(again, param, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match=r"`checkpoint` must be a local directory .* got 'gpt2'"):
        HFCausalLM(checkpoint="gpt2")
    with pytest.raises(ValueError, match=r"vocabulary holds 64 ids, but the data's `vocab_size` is 256"):
        HFCausalLM(vocab_size=256, n_positions=32, checkpoint=str(tmp_path / "saved"))


LLAMA = CONFIG.parent / "llama.yaml"
ONE_PROCESS = ["--trainer.devices=1", "--trainer.strategy=auto", "--trainer.logger=false"]


def test_a_llama_is_a_yaml_change(tmp_path: Path) -> None:
    # The shipped overlay after the shipped config: a tiny Llama from its LlamaConfig, sized by the data's links.
    cli = main(["--config", str(CONFIG), "--config", str(LLAMA), "--data.vocab_size=300", *ONE_PROCESS], run=False)
    model = cli.model.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.config.vocab_size, model.config.max_position_embeddings) == (300, cli.datamodule.max_length)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    # It trains on the example's batches as the GPT-2 does: its own shifted token mean, a finite gradient.
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    loss = cli.model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in cli.model.parameters())
    # The same YAML without the overlay is the GPT-2 it always was.
    gpt2 = main(["--config", str(CONFIG), *ONE_PROCESS], run=False).model.model.config
    assert (gpt2.model_type, gpt2.n_layer, gpt2.n_embd, gpt2.resid_pdrop) == ("gpt2", 2, 64, 0.0)


def test_gpt2_sizes_beside_a_config_are_refused() -> None:
    from transformers import LlamaConfig

    with pytest.raises(
        ValueError, match=r"\{'n_layer': 2\} set the sizes of the GPT-2 .* a LlamaConfig.* drop n_layer"
    ):
        HFCausalLM(n_layer=2, config=LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32))


# ---------------------------------------------------------------------------------------------------------------
# one step of the example, in-process, against one full-batch pass of the same model
# ---------------------------------------------------------------------------------------------------------------
class _StepRecorder(pl.Callback):
    """The step batch as the dataloader gave it, and the gradient the optimizer step sees (before clipping)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Tensor]] = []
        self.grads: list[dict[str, Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batches.append({k: v.clone() for k, v in batch.items()})

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})


def test_one_step_of_the_example_is_one_full_batch_token_mean_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The example's own module, data and callbacks, from its YAML; one process instead of two.
    monkeypatch.setattr(sys, "argv", ["main.py"])  # pytest's arguments are not the CLI's
    cli = main(
        [
            f"--config={CONFIG}",
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.num_samples=256",
        ],
        run=False,
    )
    module, trainer = cli.model, cli.trainer
    assert any(isinstance(c, AutoMicroBatching) for c in trainer.callbacks)
    recorder = _StepRecorder()
    trainer.callbacks.append(recorder)
    micro_batches: list[dict[str, Tensor]] = []
    training_step = module.training_step

    def recording_step(batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        micro_batches.append({k: v.clone() for k, v in batch.items()})
        return training_step(batch, batch_idx)

    module.training_step = recording_step  # type: ignore[method-assign]
    initial = copy.deepcopy(module.model)
    trainer.fit(module, datamodule=cli.datamodule)

    (batch,) = recorder.batches
    assert len(batch["input_ids"]) == 32
    widths = {int(m["input_ids"].shape[1]) for m in micro_batches}
    assert len(micro_batches) > 1 and len(widths) > 1, "the step should be cut into trimmed micro-batches"
    assert all(m["input_ids"].numel() <= 1024 or len(m["input_ids"]) == 1 for m in micro_batches)

    # The reference: the model's own loss on the whole step batch (its mean over labels[..., 1:] != -100), AdamW.
    reference = copy.deepcopy(initial)
    loss = reference(**batch).loss
    loss.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(
            recorder.grads[0][f"model.{name}"], param.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    exact = {name: param.grad.clone() for name, param in reference.named_parameters()}
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the YAML's gradient_clip_val
    optimizer = torch.optim.AdamW(reference.parameters(), lr=module.lr, weight_decay=module.weight_decay)
    optimizer.step()
    # AdamW's first step moves each weight by lr * g / (|g| + 1e-8): where the exact gradient is float noise (the
    # attention's key bias, which softmax ignores, has |g| ~ 1e-14), the direction is noise too, so those are left out.
    for (name, param), (_, expected) in zip(module.model.named_parameters(), reference.named_parameters(), strict=True):
        informative = exact[name].abs() > 1e-6
        torch.testing.assert_close(
            param[informative], expected[informative], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert not torch.equal(param, initial.get_parameter(name)), f"{name} did not move"

    # What the exactness is for: the mean of the micro-batches' means is another gradient.
    naive = copy.deepcopy(initial)
    (sum(naive(**m).loss for m in micro_batches) / len(micro_batches)).backward()
    head = "transformer.wte.weight"
    assert not torch.allclose(dict(naive.named_parameters())[head].grad, recorder.grads[0][f"model.{head}"], rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# the run a user starts: 2 CPU ranks, the shipped YAML, CSV and offline W&B logs
# ---------------------------------------------------------------------------------------------------------------
def run_example(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the example's command in ``cwd``; on timeout, kill its whole process group (rank 1 and W&B included)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HUB_OFFLINE": "1",
        **{var: str(cwd / "wandb_home") for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")},
    }
    command = [sys.executable, "-m", "examples.hf_finetune.main", "fit", f"--config={CONFIG}", *args]
    return h.run_process_group(command, cwd=cwd, env=env, timeout=RUN_TIMEOUT_S, what="the example")


@pytest.mark.ddp
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_yaml_run_on_two_ranks_logs_to_csv_and_wandb_and_keeps_the_ranks_equal(tmp_path: Path) -> None:
    done = run_example(
        tmp_path,
        f"--trainer.max_steps={STEPS}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--data.num_samples=512",
        "--trainer.callbacks+=tests.examples.test_hf_finetune.SaveRankParameters",
        f"--trainer.callbacks.dirpath={tmp_path / 'ranks'}",
    )
    assert done.returncode == 0, done.stdout[-6000:]
    assert "Traceback" not in done.stdout, done.stdout[-6000:]
    logs = tmp_path / "runs" / "hf_finetune"  # the YAML's save_dir, relative to where the command ran

    # CSV: one row per optimizer step with the monitor's keys, the token budget, and finite losses.
    (metrics,) = logs.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    monitored = [r for r in rows if r[keys.WINDOW_LOSS]]
    assert [int(r["step"]) for r in monitored] == list(range(STEPS))
    for key in (*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS, *keys.TOKEN_KEYS):
        assert all(r[key] != "" for r in monitored), key
    assert {float(r[keys.MICRO_BATCH_TOKENS]) for r in monitored} == {1024.0}
    assert {float(r[keys.EFFECTIVE_BATCH_SIZE]) for r in monitored} == {64.0}  # 32 a rank, both ranks
    assert all(float(r[keys.ACCUMULATION_STEPS]) > 1 for r in monitored)
    losses = [float(r["train/loss"]) for r in rows if r["train/loss"]] + [float(r[keys.WINDOW_LOSS]) for r in monitored]
    assert len(losses) == 2 * STEPS and all(math.isfinite(v) and 0 < v < 10 for v in losses), losses

    # W&B, offline, read back from its .wandb file: the same keys and the same values as the CSV.
    from lightning_accum.integrations.wandb_offline import read_offline_run

    run = read_offline_run(logs / "wandb", wait_s=30)
    assert run.complete and run.exit_code == 0 and run.project == "lightning-accum-hf-finetune"
    assert [step for step, _ in run.column(keys.MICRO_BATCH_TOKENS)] == list(range(STEPS))
    for key in (keys.WINDOW_LOSS, keys.ITEMS_PER_STEP, keys.MICRO_BATCH_TOKENS, keys.ACCUMULATION_STEPS):
        assert [value for _, value in run.column(key)] == pytest.approx([float(r[key]) for r in monitored]), key

    # Both ranks end with the same parameters, which moved, and which the Lightning checkpoint holds.
    start = torch.load(tmp_path / "ranks" / "start_rank0.pt")
    end = [torch.load(tmp_path / "ranks" / f"end_rank{rank}.pt") for rank in (0, 1)]
    (checkpoint,) = logs.glob("csv/version_*/checkpoints/*.ckpt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    for name, param in end[0].items():
        torch.testing.assert_close(end[1][name], param, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(saved[name], param, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert any(not torch.equal(start[name], end[0][name]) for name in start), "training did not move the parameters"
