"""The built wheel is a working package on its own (runs in CI: no marker, no network needed).

The fakes live in the top-level `meta/` folder and ship as `moe_ops.meta` through pyproject's
package-dir mapping; an editable install hides a mistake there (the source tree is importable),
so this test builds a real wheel, installs it into a temporary --target, and imports it in a
subprocess where the source tree is not on the path.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Build from a copy: building in the repository writes build/ there, and setuptools' stale
# build/lib would leak deleted modules into the wheel (and race with other test processes).
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                     "__pycache__", ".hypothesis", ".pytest_cache", "tests",
                                     "benchmarks", "*.so")

SMOKE = textwrap.dedent("""
    import sys
    import moe_ops, moe_ops.meta, torch
    from pathlib import Path

    # Imported from the installed copy, not the source tree.
    target = Path(sys.argv[1]).resolve()
    for module in (moe_ops, moe_ops.meta):
        assert target in Path(module.__file__).resolve().parents, module.__file__

    gen = torch.Generator().manual_seed(0)
    E, H, I = 4, 32, 16
    layer = moe_ops.FusedMoE(E, H, I, 2, dtype=torch.float32)
    layer.load_weights(w1=torch.randn(E, I, H, generator=gen), w2=torch.randn(E, H, I, generator=gen),
                       w3=torch.randn(E, I, H, generator=gen))
    x = torch.randn(3, H, generator=gen)
    out = layer(x, torch.randn(3, E, generator=gen))
    assert out.shape == (3, H) and torch.isfinite(out).all() and out.abs().sum() > 0

    # The fakes are registered: the ops run under FakeTensorMode without touching data.
    from torch._library import simple_registry
    from torch._subclasses.fake_tensor import FakeTensorMode
    for name in ("route", "align_tokens", "fused_experts", "fused_moe"):
        assert simple_registry.singleton.find("moe_ops::" + name).fake_impl.kernel is not None, name
    mode = FakeTensorMode()
    ids = torch.randint(0, E, (3, 2), dtype=torch.int32, generator=gen)
    args = [mode.from_tensor(t) for t in (x, ids, torch.rand(3, 2, generator=gen))]
    weights = [mode.from_tensor(t) for t in layer.kernel_weights().values()]
    with mode:
        fake = torch.ops.moe_ops.fused_experts(*args, *weights, None, None, None, None, None, None,
                                               "swiglu", "none", 1.702, 7.0, 0, "auto")
    assert fake.shape == (3, H) and fake.dtype == torch.float32, fake
    assert type(fake).__name__ == "FakeTensor", type(fake)
    print("OK", moe_ops.__version__)
""")


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, timeout=180, **kwargs)
    assert result.returncode == 0, f"{args}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def test_wheel_ships_the_fakes_and_works_without_the_source_tree(tmp_path):
    if not (REPO_ROOT / "pyproject.toml").exists():
        pytest.fail(f"no pyproject.toml at {REPO_ROOT}")
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_COPIED)
    wheels = tmp_path / "wheels"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.pop("PYTHONPATH", None)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheels), str(source)], env=env, cwd=tmp_path)
    built = sorted(wheels.glob("moe_ops-*.whl"))
    assert len(built) == 1, built
    names = set(zipfile.ZipFile(built[0]).namelist())
    for required in ("moe_ops/__init__.py", "moe_ops/ops.py", "moe_ops/meta/__init__.py",
                     "moe_ops/kernels/__init__.py"):
        assert required in names, f"{required} missing from {built[0].name}: {sorted(names)}"
    assert not any(n.startswith(("meta/", "tests/")) for n in names), sorted(names)
    # the tuned tables ship as package data
    tables = {f"moe_ops/tuned/{p.name}" for p in (REPO_ROOT / "moe_ops" / "tuned").glob("*.json")}
    assert tables <= names, sorted(tables - names)

    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
          str(target), str(built[0])], env=env, cwd=tmp_path)

    # cwd = tmp_path and PYTHONPATH = target only: the repository is not importable. -I would
    # also drop the venv's site-packages (torch), so -s/-E style isolation is done by hand.
    run_env = dict(env, PYTHONPATH=str(target), PYTHONNOUSERSITE="1", TRITON_INTERPRET="0")
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    result = _run([sys.executable, str(script), str(target)], env=run_env, cwd=tmp_path)
    assert result.stdout.strip().startswith("OK"), result.stdout
