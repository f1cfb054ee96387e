"""The fp8 tile launches' pre-wait prefetch of their own weight rows (grouped_gemm.PREFETCH_OWN_K):
the sm_90 builds ask the L2 for the rows before the program waits for the launch before it
(what the interpreter, which runs no inline PTX and no PDL, cannot check), and on a GPU the
experts call gives the same output bit for bit with and without it (a prefetch changes no
value), against the oracle."""
import pytest
import torch

from moe_ops.kernels import grouped_gemm
from moe_ops.kernels.grouped_gemm import GemmConfig
from moe_ops.kernels.experts import triton_experts
from test_kernels_experts import DEVICE, FP8_TOL, TOL, experts_f64, make_problem, rel_err
from test_ws_gemm import sm90_script_rows

SM90_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import compile_config, sass
from moe_ops.kernels.grouped_gemm import GemmConfig
for quant, gemm, swap, split, direct in (("fp8", 1, False, 1, True), ("fp8", 2, False, 2, False),
                                         ("fp8_block", 1, True, 1, False),
                                         ("fp8_block", 2, True, 2, True)):
    for prefetch_k in (0, 1024):
        kernel = compile_config(quant, gemm, 2048, GemmConfig(16, 64, 128, 8, 4, 4, swap, split),
                                direct, prefetch_k=prefetch_k)
        ops = [i.split()[0] for i in sass(kernel)]
        local = sum(op.startswith(("LDL", "STL")) for op in ops)
        ptx = kernel.asm["ptx"]
        bulk = ptx.find("cp.async.bulk.prefetch.L2.global")
        wait = ptx.find("griddepcontrol.wait")
        print(quant, prefetch_k, local, int(bulk >= 0), int(0 <= bulk < wait))
"""


def test_prefetch_own_builds_for_sm90():
    """With PREFETCH_K the sm_90 builds (fp8 and fp8_block, GEMM1 and GEMM2, direct and
    dispatched, split-K) issue the bulk requests before griddepcontrol.wait, without local
    memory; without it none."""
    rows, done = sm90_script_rows(SM90_BUILDS)
    rows = [row for row in rows if row]
    assert len(rows) == 8, done.stdout
    for quant, prefetch_k, local, has_bulk, before_wait in rows:
        assert local == "0", done.stdout
        assert has_bulk == before_wait == ("1" if prefetch_k != "0" else "0"), done.stdout


def test_prefetch_own_k_rules(monkeypatch):
    """_prefetch_own_k: the bytes (rounded down to 16) only for fp8 / fp8_block 1-byte weights
    with the early launch on and 16-byte aligned rows and K steps; 0 otherwise (and always on a
    CPU: no PDL)."""
    w8 = torch.zeros(2, 64, 256, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(grouped_gemm, "PREFETCH_OWN_K", 1000)
    monkeypatch.setattr(grouped_gemm, "pdl_launch_options", lambda device: {"launch_pdl": True})
    assert grouped_gemm._prefetch_own_k("fp8", w8, 128) == 992
    assert grouped_gemm._prefetch_own_k("fp8_block", w8, 128) == 992
    assert grouped_gemm._prefetch_own_k("none", w8.to(torch.bfloat16), 128) == 0
    assert grouped_gemm._prefetch_own_k("fp8", w8[:, :, 8:], 128) == 0   # rows not aligned
    assert grouped_gemm._prefetch_own_k("fp8", w8, 8) == 0                # split chunks not
    monkeypatch.setattr(grouped_gemm, "pdl_launch_options", lambda device: {})
    assert grouped_gemm._prefetch_own_k("fp8", w8, 128) == 0
    monkeypatch.setattr(grouped_gemm, "PREFETCH_OWN_K", 0)
    monkeypatch.setattr(grouped_gemm, "pdl_launch_options", lambda device: {"launch_pdl": True})
    assert grouped_gemm._prefetch_own_k("fp8", w8, 128) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the bulk prefetch is inline PTX (sm_90)")
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_prefetch_own_same_output(quant, monkeypatch):
    """Qwen3-30B-A3B's shapes at T = 1, 4 and 40 (direct and dispatched, ids -1 among them;
    T = 4 also with GEMM2 split over K, as the shipped decode tables do): the call with the
    prefetch (taken: its launches get PREFETCH_K > 0) equals the call without it bit for bit,
    and the oracle."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90 or later")
    taken, real = [], grouped_gemm._prefetch_own_k
    monkeypatch.setattr(grouped_gemm, "_prefetch_own_k",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    split = dict(gemm1_config=GemmConfig(16, 64, 128, 8, 4, 4),
                 gemm2_config=GemmConfig(16, 64, 128, 8, 4, 4, False, 2))
    for T, configs in ((1, {}), (4, {}), (4, split), (40, {})):
        tensors, kwargs = make_problem(T, 2048, 768, 128, 8, quant=quant, seed=T,
                                       invalid_ids=True)
        outs = []
        for prefetch_k in (0, 1024, 0, 4096):
            monkeypatch.setattr(grouped_gemm, "PREFETCH_OWN_K", prefetch_k)
            del taken[:]
            outs.append(triton_experts(*tensors, **kwargs, **configs))
            assert taken and all((k > 0) == (prefetch_k > 0) for k in taken), taken
        assert all(torch.equal(out, outs[0]) for out in outs)
        ref = experts_f64(*tensors, **kwargs)
        assert rel_err(outs[1], ref) <= (FP8_TOL if quant == "fp8" else TOL[torch.bfloat16])
