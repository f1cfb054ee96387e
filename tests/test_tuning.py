"""The tuner's logic on CPU (SPEC §6): buckets, keys, the lookup chain, the cache file, profiling
with fake runners and timers, no profiling while capturing or compiling, bounded memory, and
the lookup hook of triton_experts."""
import dataclasses
import json
import multiprocessing
import os
import time
import warnings

import pytest
import torch

import moe_ops.kernels.experts as kexperts
from moe_ops import kernels
from moe_ops import tuning
from moe_ops.kernels.grouped_gemm import GemmConfig, GemmProblem, default_config, is_valid_config
from moe_ops.tuning import (
    ProblemKey, Tuner, TuningCacheWarning, autotune, bucket_of, force_config, problem_key,
    read_cache_file, token_buckets, write_cache_file,
)

PROBLEM1 = GemmProblem(1, 8, 128, 64, 1.0, torch.bfloat16, "none", True)
PROBLEM2 = GemmProblem(2, 8, 64, 64, 1.0, torch.bfloat16, "none", True)
FAST = GemmConfig(32, 64, 64, 8, 4, 3)
WRONG = GemmConfig(16, 32, 32, 1, 4, 2)   # the fastest, but its output is wrong
SLOW = GemmConfig(64, 64, 32, 8, 4, 2)


def key_at(num_tokens=4, problem=PROBLEM1, **overrides):
    key = problem_key(problem, num_tokens=num_tokens, top_k=2, activation="swiglu")
    return dataclasses.replace(key, **overrides)


class FakeRunner:
    """Outputs: the default's and FAST/SLOW's agree, WRONG's does not; the fake timer reads the
    config of the last run."""

    def __init__(self, candidates=(SLOW, WRONG, FAST), fail=()):
        self._candidates = list(candidates)
        self.fail = set(fail)
        self.last = None
        self.runs = 0

    def candidates(self, key):
        return self._candidates

    def default(self, key):
        return default_config(key.problem())

    def run(self, key, config):
        self.runs += 1
        self.last = config
        if config in self.fail:
            raise RuntimeError("does not compile")
        out = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
        return out * 3 if config == WRONG else out


def fake_timer(runner, times):
    def timer(fn):
        fn()
        return times.get(runner.last, 1.0)
    return timer


@pytest.fixture
def tuner(tmp_path):
    return Tuner(shipped_dir=tmp_path / "no_shipped_tables")


# -- buckets ----------------------------------------------------------------------------------

def test_buckets_powers_of_two_up_to_max():
    assert token_buckets() == [2 ** i for i in range(14)]
    assert token_buckets(100)[-1] == 100 and token_buckets(100)[-2] == 64
    assert [bucket_of(t) for t in (1, 2, 3, 4, 5, 127, 128, 129)] == [1, 2, 4, 4, 8, 128, 128, 256]
    assert bucket_of(8192) == 8192 and bucket_of(8193) == 8192 and bucket_of(10 ** 6) == 8192
    assert bucket_of(70, max_num_tokens=100) == 100 and bucket_of(33, 100) == 64
    for t in range(1, 9000):
        assert bucket_of(t) in token_buckets()
    with pytest.raises(ValueError):
        bucket_of(0)


def test_linked_inputs_share_one_bucket():
    x = torch.empty(5, 16)
    ids = torch.empty(5, 2)
    scale_t = torch.empty(3, 5)   # a scale whose token dim is dim 1
    assert tuning.linked_token_count(x, ids, (scale_t, 1), None) == 5
    with pytest.raises(ValueError):
        tuning.linked_token_count(x, (scale_t, 0))


def test_zero_tokens_never_looked_up(tuner, monkeypatch):
    calls = []
    monkeypatch.setattr(kexperts, "experts_configs", lambda *a, **k: calls.append(1))
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    out = kexperts.triton_experts(x, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2),
                                  torch.empty(8, 128, 64), torch.empty(8, 64, 64))
    assert out.shape == (0, 64) and not calls


# -- keys -------------------------------------------------------------------------------------

def test_key_holds_every_component():
    key = key_at()
    assert key.kernel == "grouped_gemm" and len(key.kernel_hash) == 16
    assert key.gpu == tuning.gpu_name() and key.bucket == 4 and key.dtype == "bfloat16"
    assert ProblemKey.from_str(key.as_str()) == key
    assert key.problem() == dataclasses.replace(PROBLEM1, tokens_per_expert=4 * 2 / 8)


CHANGES = {"kernel": "other_kernel", "kernel_hash": "0" * 16, "gemm": 2, "num_experts": 16,
           "n": 256, "k": 128, "top_k": 4, "quant": "fp8", "activation": "geglu", "gated": False,
           "dtype": "float16", "local_experts": 4, "gpu": "Some other GPU", "bucket": 8}


def test_key_fields_all_covered():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(ProblemKey)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_any_key_component_misses(tuner, field):
    key = key_at()
    tuner.memory[key] = FAST
    assert tuner.lookup(key) == FAST
    assert tuner.lookup(dataclasses.replace(key, **{field: CHANGES[field]})) is None


def test_problem_key_derives_components_from_the_problem():
    base = key_at()
    assert key_at(num_tokens=3) == base                      # same bucket
    assert key_at(num_tokens=5) != base
    fp8 = dataclasses.replace(PROBLEM1, quant="fp8")
    assert key_at(problem=fp8).quant == "fp8"
    assert key_at(problem=dataclasses.replace(PROBLEM1, dtype=torch.float16)).dtype == "float16"
    assert problem_key(PROBLEM1, num_tokens=4, top_k=2, activation="swiglu",
                       num_experts=64).num_experts == 64


def test_kernel_hash_is_the_source_text_hash():
    """The hash covers the kernel's module and the device functions' module (common.py)."""
    import hashlib
    import moe_ops.kernels.common as common
    import moe_ops.kernels.grouped_gemm as gg
    digest = hashlib.sha256()
    for module in (gg, common):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    assert tuning.kernel_source_hash() == digest.hexdigest()[:16]


# -- lookup chain -----------------------------------------------------------------------------

def write_table(path, entries, **meta_overrides):
    meta = tuning.current_metadata()
    meta.update(meta_overrides)
    path.write_text(json.dumps({"metadata": meta, "entries": {
        k.as_str(): {"config": dataclasses.asdict(c)} for k, c in entries.items()}}))


def test_lookup_order_memory_user_shipped_default(tmp_path):
    shipped = tmp_path / "tuned"
    shipped.mkdir()
    k_all, k_user, k_shipped, k_none = (key_at(n) for n in (1, 2, 4, 8))
    write_table(shipped / "h.json", {k_all: SLOW, k_user: SLOW, k_shipped: SLOW})
    # another GPU's table next to it: skipped silently
    write_table(shipped / "other.json", {k_none: SLOW}, gpu="Other GPU")
    user = tmp_path / "user.json"
    write_table(user, {k_all: WRONG, k_user: WRONG})
    tuner = Tuner(shipped_dir=shipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuner.load(user)
        tuner.memory[k_all] = FAST
        assert tuner.lookup(k_all) == FAST
        assert tuner.lookup(k_user) == WRONG
        assert tuner.lookup(k_shipped) == SLOW
        assert tuner.lookup(k_none) is None
    assert tuner.config_for(k_none.problem(), k_none) == default_config(k_none.problem())


def test_missing_shipped_folder_is_fine(tmp_path):
    tuner = Tuner(shipped_dir=tmp_path / "absent")
    assert tuner.shipped == {} and tuner.lookup(key_at()) is None
    assert Tuner().lookup(key_at()) is None   # the package's own folder (may not exist yet)


# -- cache file -------------------------------------------------------------------------------

def test_file_round_trip(tuner, tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    runner = FakeRunner()
    with autotune(cache=path, tuner=tuner):
        assert tuner.tune(key_at(), runner, fake_timer(runner, {FAST: 0.1})) == FAST
    data = json.loads(path.read_text())
    assert data["metadata"] == tuning.current_metadata()
    for field in ("package", "package_version", "torch", "triton", "gpu", "kernel_hash"):
        assert field in data["metadata"]
    fresh = Tuner(shipped_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.load_cache(path, tuner=fresh) == 1
    assert fresh.lookup(key_at()) == FAST
    assert not list(path.parent.glob("*.tmp"))


def test_kernel_hash_of_the_4bit_modes_covers_their_decode():
    """The 4-bit problems' kernel source adds fp4_decode.py to grouped_gemm's: a change of the
    4-bit decode invalidates their tables only; the other modes' keys keep the plain hash."""
    import hashlib
    import moe_ops.kernels.common as common
    import moe_ops.kernels.fp4_decode as fp4_decode
    import moe_ops.kernels.grouped_gemm as gg
    digest = hashlib.sha256()
    for module in (gg, common, fp4_decode):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    for quant in ("nvfp4", "mxfp4"):
        assert tuning.kernel_source_hash(quant=quant) == digest.hexdigest()[:16]
    for quant in ("none", "fp8", "fp8_block"):
        assert tuning.kernel_source_hash(quant=quant) == tuning.kernel_source_hash()
    assert key_at().kernel_hash == tuning.kernel_source_hash(quant=key_at().quant)


def test_entries_of_another_kernel_source_ignored_with_one_warning(tmp_path):
    path = tmp_path / "t.json"
    stale = {dataclasses.replace(key_at(b), kernel_hash="0" * 16): FAST for b in (1, 2)}
    write_table(path, {**stale, key_at(4): FAST})
    with pytest.warns(TuningCacheWarning) as record:
        assert read_cache_file(path) == {key_at(4): FAST}
    assert len(record) == 1 and "kernel source" in str(record[0].message)


@pytest.mark.parametrize("field", ["torch", "triton", "package_version", "gpu"])
def test_metadata_mismatch_ignored_with_one_warning(tmp_path, field):
    path = tmp_path / "t.json"
    write_table(path, {key_at(1): FAST, key_at(2): FAST, key_at(4): FAST}, **{field: "other"})
    with pytest.warns(TuningCacheWarning) as record:
        assert read_cache_file(path) == {}
    assert len(record) == 1 and field in str(record[0].message)


def test_malformed_entries_one_warning(tmp_path):
    path = tmp_path / "t.json"
    write_table(path, {key_at(1): FAST})
    data = json.loads(path.read_text())
    data["entries"]["garbage"] = {"config": {}}
    data["entries"][key_at(2).as_str()] = {"config": {"block_m": "x"}}
    data["entries"][key_at(4).as_str()] = {"config": {"block_m": 24}}   # invalid config
    path.write_text(json.dumps(data))
    with pytest.warns(TuningCacheWarning) as record:
        assert read_cache_file(path) == {key_at(1): FAST}
    assert len(record) == 1


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[]", b'{"entries": 3}', b""])
def test_corrupt_file_warns_never_crashes(tuner, tmp_path, content):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    runner = FakeRunner()
    with pytest.warns(TuningCacheWarning):
        with autotune(cache=path, tuner=tuner):
            tuner.tune(key_at(), runner, fake_timer(runner, {FAST: 0.1}))
    assert Tuner(shipped_dir=None).load(path) == 1   # rewritten whole


def test_unreadable_file_warns(tuner, tmp_path):
    path = tmp_path / "dir.json"
    path.mkdir()   # reading a folder raises OSError
    with pytest.warns(TuningCacheWarning):
        assert tuner.load(path) == 0


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    write_cache_file(path, {key_at(1): {"config": dataclasses.asdict(FAST)}})
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_cache_file(path, {key_at(2): {"config": dataclasses.asdict(SLOW)}})
    assert path.read_text() == before
    assert not list(tmp_path.glob("*.tmp"))


def _writer(path, keys, metadata):
    # keys and metadata come from the parent: a forked child must not touch CUDA
    for key in keys:
        write_cache_file(path, {key: {"config": dataclasses.asdict(FAST)}}, metadata)


def test_concurrent_writers_merge(tmp_path):
    path = str(tmp_path / "t.json")
    ctx = multiprocessing.get_context("fork")
    metadata = tuning.current_metadata()
    keys = [[key_at(1, n=128 + 32 * (w * 8 + i)) for i in range(8)] for w in range(4)]
    procs = [ctx.Process(target=_writer, args=(path, keys[w], metadata)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = read_cache_file(path)
    assert len(entries) == 32


# -- profiling --------------------------------------------------------------------------------

def test_fastest_correct_candidate_wins(tuner):
    runner = FakeRunner(candidates=(SLOW, WRONG, FAST, GemmConfig(16, 64, 64)),
                        fail={GemmConfig(16, 64, 64)})
    timer = fake_timer(runner, {WRONG: 0.01, FAST: 0.1, SLOW: 0.5})
    key = key_at()
    with autotune(tuner=tuner):
        assert tuner.config_for(key.problem(), key, runner, timer) == FAST
    record = tuner.records[key]
    assert record["rejected"] == 2 and record["candidates"] == 4
    assert record["us"] == pytest.approx(0.1e6) and record["default_us"] == pytest.approx(1e6)
    runs = runner.runs
    with autotune(tuner=tuner):       # tuned: no second profiling
        assert tuner.config_for(key.problem(), key, runner, timer) == FAST
    assert runner.runs == runs and tuner.profile_count == 1


def test_deadline_skips_the_candidates_left(tuner):
    """Past the deadline only the default is profiled; the record counts the rest as skipped."""
    runner = FakeRunner(candidates=(SLOW, FAST))
    key = key_at()
    with autotune(tuner=tuner):
        best = tuner.tune(key, runner, fake_timer(runner, {FAST: 0.1, SLOW: 0.5}),
                          deadline=time.perf_counter() - 1.0)
    assert best == default_config(key.problem())
    record = tuner.records[key]
    assert record["candidates"] == 0 and record["skipped"] == 2
    with autotune(tuner=tuner):        # a deadline far ahead changes nothing
        tuner.memory.clear()
        tuner.records.clear()
        assert tuner.tune(key, runner, fake_timer(runner, {FAST: 0.1, SLOW: 0.5}),
                          deadline=time.perf_counter() + 3600) == FAST
    assert tuner.records[key]["skipped"] == 0


def test_default_kept_when_nothing_beats_it(tuner):
    runner = FakeRunner()
    key = key_at()
    with autotune(tuner=tuner):
        best = tuner.tune(key, runner, fake_timer(runner, {FAST: 2.0, SLOW: 3.0, WRONG: 0.0}))
    assert best == default_config(key.problem())


def test_outside_context_lookup_only(tuner):
    runner = FakeRunner()
    key = key_at()
    assert tuner.config_for(key.problem(), key, runner, fake_timer(runner, {})) == \
        default_config(key.problem())
    assert tuner.tune(key, runner) is None
    assert runner.runs == 0 and not tuner.memory


@pytest.mark.parametrize("predicate", ["capturing", "compiling"])
def test_no_profiling_while_capturing_or_compiling(tuner, monkeypatch, predicate):
    if predicate == "capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    runner = FakeRunner()
    key = key_at()
    tuner.memory[key_at(8)] = SLOW
    with autotune(tuner=tuner):
        assert tuner.config_for(key.problem(), key, runner, fake_timer(runner, {})) == \
            default_config(key.problem())
        assert tuner.config_for(key.problem(), key_at(8), runner) == SLOW   # lookups still work
    assert runner.runs == 0 and tuner.profile_count == 0


def test_predicates_default_false_on_cpu():
    assert tuning.is_capturing() is False and tuning.is_compiling() is False


def test_list_default_force(tuner):
    configs = tuning.valid_configs(PROBLEM1)
    assert configs and all(is_valid_config(PROBLEM1, c) for c in configs)
    assert tuner.valid_configs(PROBLEM1) == configs
    assert tuner.default(PROBLEM1) == default_config(PROBLEM1)
    key = key_at()
    tuner.memory[key] = SLOW
    with force_config(gemm1=FAST, tuner=tuner):
        assert tuner.config_for(key.problem(), key) == FAST
        assert tuner.lookup(dataclasses.replace(key, gemm=2)) is None
    assert tuner.config_for(key.problem(), key) == SLOW
    with force_config(gemm1=GemmConfig(block_m=24), tuner=tuner):
        with pytest.raises(ValueError):
            tuner.config_for(key.problem(), key)


def test_memory_bounded_over_10000_lookups(tuner):
    key = key_at()
    tuner.memory[key] = FAST
    sizes = set()
    for t in range(1, 10_001):
        k = problem_key(PROBLEM1, num_tokens=t % 7 + 1, top_k=2, activation="swiglu")
        tuner.config_for(PROBLEM1, k)
        sizes.add(tuner.cache_size())
    assert max(sizes) <= len(token_buckets())
    before = tuner.cache_size()
    for _ in range(10_000):
        assert tuner.config_for(PROBLEM1, key) is FAST
    assert tuner.cache_size() == before
    assert len(tuner.memory) == 1 and not tuner.records


# -- the triton_experts hook ------------------------------------------------------------------

class Stop(Exception):
    pass


def seen_configs(monkeypatch, tuner, T=1):
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    seen = {}

    def fake_gemm1(*args, **kwargs):
        seen["config1"] = args[7]
        raise Stop

    monkeypatch.setattr(kexperts, "gemm1", fake_gemm1)
    monkeypatch.setattr(kexperts, "experts_configs", tuning.experts_configs)
    orig = tuning.experts_configs

    def spy(p1, p2, **kw):
        seen["configs"] = orig(p1, p2, **kw)
        seen["problems"] = (p1, p2)
        return seen["configs"]
    monkeypatch.setattr(kexperts, "experts_configs", spy)
    E, H, I = 8, 64, 64
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ids = torch.arange(2 * T, dtype=torch.int32).reshape(T, 2) % E
    with pytest.raises(Stop):
        kexperts.triton_experts(x, ids, torch.ones(T, 2), torch.randn(E, 2 * I, H,
                                dtype=torch.bfloat16), torch.randn(E, H, I, dtype=torch.bfloat16))
    return seen


def test_hook_untuned_is_default(monkeypatch, tuner):
    seen = seen_configs(monkeypatch, tuner)
    p1, p2 = seen["problems"]
    assert seen["configs"] == (default_config(p1), default_config(p2))
    assert seen["config1"] == default_config(p1)


def test_hook_uses_tuned_and_forced(monkeypatch, tuner):
    p1 = GemmProblem(1, 8, 128, 64, 2 / 8, torch.bfloat16, "none", True)
    # the hook keys by the tensors' device: CPU tensors here, whatever the machine has
    key = problem_key(p1, num_tokens=1, top_k=2, activation="swiglu", device=torch.device("cpu"))
    tuner.memory[key] = FAST
    seen = seen_configs(monkeypatch, tuner)
    assert seen["config1"] == FAST
    assert seen["configs"][1] == default_config(seen["problems"][1])
    with force_config(gemm1=SLOW, gemm2=SLOW, tuner=tuner):
        assert seen_configs(monkeypatch, tuner)["configs"] == (SLOW, SLOW)


def run_experts(T=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H, I = 8, 64, 64
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = (torch.arange(2 * T, dtype=torch.int32).reshape(T, 2) * 3) % E
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / 8).to(torch.bfloat16)
    return kexperts.triton_experts(x, ids, torch.full((T, 2), 0.5), w13, w2)


@pytest.mark.skipif(not kernels.INTERPRET, reason="CPU tensors through the Triton interpreter")
def test_triton_experts_profiles_inside_autotune(monkeypatch, tuner, tmp_path):
    """The real kernels (Triton interpreter on CPU), two candidates a GEMM, a fake timer that
    makes the last candidate timed the fastest."""
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    cands = [GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 64, 64, 8, 4, 2)]
    monkeypatch.setattr(tuning, "experts_candidates", lambda problem: cands)
    times = iter([1.0, 0.5, 0.2] * 2)
    tuner.timer = lambda fn: (fn(), next(times))[1]
    expected = run_experts()
    assert not tuner.memory
    path = tmp_path / "t.json"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with autotune(cache=path, tuner=tuner):
        torch.testing.assert_close(run_experts(), expected)
    assert not tuner.memory and not path.exists()           # capturing: lookups only
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    monkeypatch.setattr(tuning, "experts_candidates", lambda problem: cands)
    with autotune(cache=path, tuner=tuner):
        torch.testing.assert_close(run_experts(), expected)
    assert sorted(k.gemm for k in tuner.memory) == [1, 2]
    assert set(tuner.memory.values()) == {cands[1]}
    assert len(read_cache_file(path)) == 2
    runs = tuner.profile_count
    torch.testing.assert_close(run_experts(), expected)     # outside: lookup of the tuned pair
    assert tuner.profile_count == runs
