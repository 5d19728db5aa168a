from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_accum.memory import OOMFault, OOMInjector, is_oom_error, oom_error, release_memory
from lightning_accum.memory.oom import describe_error

# ---- is_oom_error ---------------------------------------------------------------------------------------------------

OOM_MESSAGES = [
    # The wording of each allocator or library, as PyTorch raises it.
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.50 GiB already allocated)",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
    "HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 63.98 GiB total capacity)",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    " 17179869184 bytes. Error code 12 (Cannot allocate memory)",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB, max allowed: 18.13 GB).",
    "XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.56 GiB total capacity)",
]

NOT_OOM = [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
    RuntimeError(),
    ValueError("CUDA out of memory"),  # right words, wrong type: not what an allocator raises
    KeyError("labels"),
    KeyboardInterrupt(),
]


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_allocator_messages_are_oom(message: str):
    assert is_oom_error(RuntimeError(message))


@pytest.mark.parametrize("exc", NOT_OOM, ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_other_errors_are_not_oom(exc: BaseException):
    assert not is_oom_error(exc)


@pytest.mark.parametrize(
    "exc",
    [torch.OutOfMemoryError("whatever"), torch.cuda.OutOfMemoryError("x"), MemoryError()],
    ids=["torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "MemoryError"],
)
def test_oom_types_are_oom(exc: BaseException):
    assert is_oom_error(exc)


def test_explicitly_chained_oom_is_oom_but_an_error_while_handling_one_is_not():
    try:
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        except RuntimeError as oom:
            raise RuntimeError("training step failed") from oom
    except RuntimeError as wrapped:
        assert is_oom_error(wrapped)
    try:
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        except RuntimeError:
            raise KeyError("bug in the except block") from None
    except KeyError as other:
        assert other.__context__ is not None
        assert not is_oom_error(other)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (MemoryError(), "MemoryError (no message)"),  # what a failed `bytearray` allocation raises
        (torch.OutOfMemoryError(), "OutOfMemoryError (no message)"),
        (RuntimeError("\n  \n"), "RuntimeError (no message)"),
        (
            oom_error("cpu", nbytes=8),
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate"
            " memory: you tried to allocate 8 bytes. Error code 12 (Cannot allocate memory)",
        ),
        (torch.OutOfMemoryError("CUDA out of memory.\nSee the documentation"), "CUDA out of memory."),
    ],
    ids=["bare-MemoryError", "empty-OutOfMemoryError", "blank", "cpu", "multi-line"],
)
def test_describe_error_never_fails_on_an_empty_message(exc: BaseException, expected: str):
    assert describe_error(exc) == expected
    short = describe_error(exc, limit=12)
    assert (
        short == expected if len(expected) <= 12 or expected.endswith("(no message)") else short == expected[:9] + "..."
    )


def test_release_memory_runs_without_a_gpu():
    release_memory()
    assert torch.ones(4).sum().item() == 4


def test_oom_error_flavors():
    cpu, cuda = oom_error("cpu", nbytes=123), oom_error("cuda", detail="(test)")
    assert type(cpu) is RuntimeError and "you tried to allocate 123 bytes" in str(cpu)
    assert isinstance(cuda, torch.OutOfMemoryError) and str(cuda).endswith("(test)")
    assert is_oom_error(cpu) and is_oom_error(cuda)
    with pytest.raises(ValueError, match=r"`flavor` must be 'cpu' or 'cuda', got 'tpu'"):
        oom_error("tpu")  # type: ignore[arg-type]


# ---- a real out-of-memory error on the CPU --------------------------------------------------------------------------

REAL_OOM_SCRIPT = textwrap.dedent(
    """
    import json, resource
    import torch
    from lightning_accum.memory import is_oom_error, release_memory

    def vm_size():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    # Leave 1 GiB of address space above what the interpreter and torch already map, then ask for 8 GiB.
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 2**30, hard))
    result = {}
    try:
        torch.ones(2 * 2**30, dtype=torch.float32)
        result["raised"] = None
    except Exception as exc:
        result["raised"] = type(exc).__name__
        result["message"] = str(exc)
        result["is_oom"] = is_oom_error(exc)
    release_memory()
    small = torch.ones(1024, 1024)  # 4 MiB: the process must still work
    result["after"] = float(small.sum())
    print(json.dumps(result))
    """
)


def test_real_cpu_oom_is_recognised_and_survivable():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", REAL_OOM_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised"] is not None, "an 8 GiB tensor under a 1 GiB address-space margin must fail"
    assert "DefaultCPUAllocator: can't allocate memory" in result["message"]
    assert result["is_oom"] is True
    assert result["after"] == 1024 * 1024


# ---- OOMInjector ----------------------------------------------------------------------------------------------------


def _calls(injector: OOMInjector, points: list[tuple[int, int, int, str]]) -> list[bool]:
    """Which of the (rank, step, micro_batch, phase) points raise."""
    raised = []
    for rank, step, micro_batch, phase in points:
        try:
            injector.check(rank=rank, step=step, micro_batch=micro_batch, phase=phase)  # type: ignore[arg-type]
            raised.append(False)
        except RuntimeError as err:
            assert is_oom_error(err)
            assert f"rank {rank}, step {step}, micro-batch {micro_batch}, {phase}" in str(err)
            raised.append(True)
    return raised


def test_injector_fires_once_at_the_chosen_point():
    injector = OOMInjector(OOMFault(step=2, micro_batch=1, phase="forward", rank=1))
    points = [
        (1, 2, 0, "forward"),  # other micro-batch
        (0, 2, 1, "forward"),  # other rank
        (1, 1, 1, "forward"),  # other step
        (1, 2, 1, "backward"),  # other phase
        (1, 2, 1, "forward"),  # this one
        (1, 2, 1, "forward"),  # the retry: spent
    ]
    assert _calls(injector, points) == [False, False, False, False, True, False]
    assert injector.fired == [(1, 2, 1, "forward")]


def test_injector_times_and_wildcards():
    injector = OOMInjector([OOMFault(step=None, micro_batch=None, times=2), OOMFault(step=5, rank=0, times=None)])
    assert _calls(injector, [(0, 0, 3, "forward"), (1, 9, 0, "forward"), (0, 1, 0, "forward")]) == [True, True, False]
    assert _calls(injector, [(0, 5, 0, "forward")] * 3 + [(1, 5, 0, "forward")]) == [True, True, True, False]


def test_injector_is_deterministic():
    faults = [OOMFault(step=1, micro_batch=None, times=3), OOMFault(step=2, phase="backward")]
    points = [(r, s, m, p) for s in range(3) for m in range(2) for r in range(2) for p in ("forward", "backward")]
    first, second = OOMInjector(faults), OOMInjector(faults)
    assert _calls(first, points) == _calls(second, points)
    assert first.fired == second.fired
    assert len(first.fired) == 4


def test_injector_imitates_a_memory_limit():
    injector = OOMInjector(OOMFault(step=None, micro_batch=None, when_size_above=8, times=None), flavor="cuda")
    for size, fails in [(32, True), (16, True), (8, False), (4, False)]:
        try:
            injector.check(rank=0, step=0, micro_batch=0, phase="forward", micro_batch_size=size)
            raised = False
        except torch.OutOfMemoryError:
            raised = True
        assert raised is fails, size
    with pytest.raises(ValueError, match=r"`when_size_above` needs `micro_batch_size=`"):
        injector.check(rank=0, step=0, micro_batch=0, phase="forward")


def test_backward_injection_raises_inside_autograd():
    torch.manual_seed(0)
    w1 = torch.randn(3, 4, requires_grad=True)
    w2 = torch.randn(4, 1, requires_grad=True)
    injector = OOMInjector(OOMFault(step=7, micro_batch=2, phase="backward"), flavor="cuda")

    hidden = torch.randn(5, 3) @ w1
    loss = (hidden @ w2).pow(2).mean()
    # Armed for another micro-batch: backward goes through.
    injector.arm_backward(loss, rank=0, step=7, micro_batch=1)
    loss.backward()
    assert w1.grad is not None

    w1.grad = None
    hidden = torch.randn(5, 3) @ w1
    loss = (hidden @ w2).pow(2).mean()
    injector.arm_backward(hidden, rank=0, step=7, micro_batch=2)  # fails half-way through the backward
    injector.check(rank=0, step=7, micro_batch=2, phase="forward")  # the forward phase is not armed
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory.*micro-batch 2, backward") as info:
        loss.backward()
    assert is_oom_error(info.value)
    assert w1.grad is None, "the gradient of w1 needs the gradient of `hidden`, which never got computed"
    assert injector.fired == [(0, 7, 2, "backward")]


def test_arm_backward_ignores_tensors_without_grad():
    injector = OOMInjector(OOMFault(phase="backward"))
    t = torch.ones(2)
    assert injector.arm_backward(t, rank=0, step=0, micro_batch=0) is t


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"faults": [object()]}, TypeError, r"`faults` must hold OOMFault objects, got <object"),
        ({"faults": OOMFault(), "flavor": "tpu"}, ValueError, r"`flavor` must be 'cpu' or 'cuda', got 'tpu'"),
    ],
)
def test_injector_validation(kwargs: dict, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        OOMInjector(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"phase": "optimizer"}, r"`phase` must be 'forward' or 'backward', got 'optimizer'"),
        ({"times": 0}, r"`times` must be >= 1, or None to fire forever, got 0"),
    ],
)
def test_fault_validation(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        OOMFault(**kwargs)
