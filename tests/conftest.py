"""Shared test set-up, run by pytest before any test module is imported.

- Without a CUDA device the Triton kernels run in the Triton interpreter on CPU tensors. The
  flag must be set before anything imports triton (torch._dynamo does, indirectly), so it is
  set here, first, for the whole session.
- One intra-op thread per test process: the tests run small tensors on a 2-core CI machine,
  usually under pytest-xdist (-n 2). torch's default thread pool then oversubscribes the cores
  and its spinning threads make every op one to two orders of magnitude slower (measured on
  this project's CI machine: a 12-expert reference forward took 0.4-2.8 s with the default pool
  under load, 10-20 ms with one thread).
"""
import os
import subprocess

import pytest


def _has_cuda() -> bool:
    # Asked without importing torch: importing torch first could pull in triton.
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def kernel_device():
    """Where the Triton kernels run: the GPU, or CPU tensors under the interpreter."""
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
                        else "cuda")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled floats and garbage ints, so kernel outputs left unwritten
    show (every kernel allocates its outputs with torch.empty)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(1 << 30)
        elif t.dtype == torch.uint8:
            t.fill_(0xFF)  # e8m0 0xFF is NaN, e2m1 0xFF is -6 | -6: unzeroed fp4 padding shows
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def gemm_calls(monkeypatch):
    """gemm_calls(module, name) replaces module.name (a launcher taking a `gemm=` keyword) by
    a wrapper that records each call's `gemm` (1 or 2) and returns the list, in call order;
    record="tile" (another keyword of the launcher) records that instead (default: the value
    recorded for calls that do not pass it)."""
    def count(module, name, record="gemm", default=None):
        calls = []
        launch = getattr(module, name)

        def counting(*args, **kwargs):
            calls.append(kwargs[record] if default is None else kwargs.get(record, default))
            return launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return calls
    return count
