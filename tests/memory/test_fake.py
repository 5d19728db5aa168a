"""``FakeTarget``: fake copies of real modules and batches, and what a CUDA target changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_accum.memory.fake import FakeTarget
from lightning_accum.memory.precision import replace_tensors
from lightning_accum.memory.tracker import MemoryTracker


def _tied() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(100, 16)
    model.head = nn.Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight
    return model


def test_module_to_meta_unties_weights_and_fake_does_not():
    # The cause of part of the old `--device meta` overestimate: `.to("meta")` made two parameters of one.
    assert len(list(_tied().to("meta").parameters())) == 2
    with FakeTarget() as fake:
        model = fake.module(_tied())
    assert len(list(model.parameters())) == 1 and isinstance(model.head.weight, FakeTensor)
    assert model.head.weight is model.embed.weight
    assert len(list(replace_tensors(_tied(), lambda t: t.to(torch.bfloat16)).parameters())) == 1


def test_a_batch_keeps_its_shared_storage_and_is_freed_after_use():
    tokens = torch.arange(2 * 9).view(2, 9)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}  # two views of one storage
    with FakeTarget() as fake, MemoryTracker() as tracker:
        fake_batch = fake.tensors(batch)
        tracker.track(fake_batch, "activations")
        assert tracker.current.total_bytes == tokens.untyped_storage().nbytes()  # counted once
        assert fake_batch["labels"].shape == (2, 8) and fake_batch["labels"].stride() == (9, 1)
        del fake_batch
        assert tracker.current.total_bytes == 0  # nothing keeps the fake storage alive


def test_copy_step_copies_no_real_memory_and_keeps_the_optimizer_state():
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with FakeTarget() as fake:
        step = fake.copy_step(model, [opt])
        model_copy, (opt_copy,) = step.module, step.optimizers
        state = opt_copy.state[model_copy.weight]
        assert isinstance(model_copy.weight, FakeTensor) and isinstance(state["exp_avg"], FakeTensor)
        assert state["step"].item() == 1  # a one-element state keeps its value
        assert opt_copy.param_groups[0]["params"][0] is model_copy.weight
    assert model.weight.grad is not None and opt.state[model.weight]["exp_avg"].device.type == "cpu"


def test_cuda_target_uses_the_foreach_optimizer_cuda_would_pick():
    params = [nn.Parameter(torch.ones(2))]
    explicit = torch.optim.AdamW(params, foreach=False)
    default = torch.optim.AdamW(params)
    with FakeTarget("cuda") as fake:
        fake.optimizers([explicit, default])
    assert explicit.param_groups[0]["foreach"] is False and default.param_groups[0]["foreach"] is True
    with FakeTarget("cpu") as fake:
        assert fake.optimizers([torch.optim.AdamW(params)])[0].param_groups[0]["foreach"] is None
    with pytest.raises(ValueError, match=r"`target` must be one of cpu, cuda, got 'xla'"):
        FakeTarget("xla")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_copies_are_fake_cpu_tensors_whatever_the_real_device(device):
    # An op on a real tensor inside the fake mode would convert it keeping its device (meta here, cuda on a GPU);
    # the copies must all be on the fake CPU device, so that they meet the batch there.
    with torch.device(device):
        model = nn.Linear(8, 8)
    model.register_buffer("scale", torch.ones(8, device=device))
    with FakeTarget() as fake:
        model_copy = fake.copy_step(model, []).module
        converted = fake.module(model)
        tensors = [*model_copy.parameters(), *model_copy.buffers(), *converted.parameters(), *converted.buffers()]
        assert {t.device.type for t in tensors} == {"cpu"}
        assert model_copy(torch.ones(2, 8)).shape == (2, 8)
