"""Autotuning of kernel configs (SPEC §6): token buckets, problem keys, the lookup chain, the
cache file, and profiling through pluggable runners and timers.

    with moe_ops.tuning.autotune(cache="tuning.json"):
        model(x)          # misses are profiled (when a runner is available), then stored
    model(x)              # outside: lookup only

Lookup order for a (problem, bucket) key: a forced config (`force_config`), then memory (tuned
in this process), then the user file given to `autotune(cache=...)` / `load_cache`, then the
tables shipped in moe_ops/tuned/*.json, then the caller's default heuristic (`None` is
returned and the caller uses `default_config(problem)` on its exact problem, so an untuned
package behaves exactly as before).

Profiling happens only inside an `autotune` context, only when the caller passes a runner, and
never while a CUDA graph is being captured or torch.compile traces: then lookups only.
triton_experts passes a runner that re-runs the call with explicit configs on the call's own
inputs (at its token count T, stored under T's bucket); each candidate's whole-call output is
compared with the default config's before it can win. Timing on a GPU replays CUDA graphs with
L2 flushed before every call (graph_timer). The candidates are each kernel's short list
(kernels/grouped_gemm.py: tuning_candidates). Tuning a whole model over every bucket on synthetic
inputs, and the shipped tables, are moe_ops/tune.py's (`python -m moe_ops.tune`).

Concurrent writers: the file is written on context exit by a read-merge-write under an
exclusive `fcntl` lock on `<cache>.lock` (where fcntl exists), the write going to a temporary
file in the same folder that then replaces the cache with `os.replace` (atomic on POSIX). Two
processes tuning the same key: the one that writes last wins that key; entries of both are
kept. Without fcntl (Windows) it degrades to last-writer-wins of whole files, still never a torn
file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence

import torch

from moe_ops.kernels.grouped_gemm import (
    GemmConfig, GemmProblem, config_space, default_config, is_valid_config, tuning_candidates,
)

TUNE_MAX_NUM_TOKENS = 8192
FORMAT_VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"
GROUPED_GEMM = "grouped_gemm"


class TuningCacheWarning(UserWarning):
    """A cache file, or some of its entries, could not be used."""


# ---------------------------------------------------------------------------------------------
# Buckets
#
# Powers of two, each token count rounded UP to the next one (capped at the largest bucket):
# - the configs' tile sizes (block_m) are powers of two and the rows per expert T*k/E crosses
#   a tile boundary at powers of two (E, k are powers of two in every model of shapes.json),
#   so that is where the best config can change; between two powers it changes little;
# - the bucket (B/2, B] is profiled at B, its costliest count, so the tuned config never
#   under-provisions tiles for the rows it serves;
# - log2(8192) + 1 = 14 buckets keeps tuning every bucket of a model within seconds.
# Finer buckets can be added where measurements show the best config changing between powers.
# ---------------------------------------------------------------------------------------------

def token_buckets(max_num_tokens: int = TUNE_MAX_NUM_TOKENS) -> List[int]:
    """All buckets: 1, 2, 4, ... up to max_num_tokens (itself the last one if not a power)."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    buckets, b = [], 1
    while b < max_num_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_tokens)
    return buckets


def bucket_of(num_tokens: int, max_num_tokens: int = TUNE_MAX_NUM_TOKENS) -> int:
    """The bucket of a token count >= 1 (T = 0 launches nothing and is never looked up)."""
    if num_tokens < 1:
        raise ValueError(f"no bucket for {num_tokens} tokens (T = 0 is never looked up)")
    if num_tokens >= max_num_tokens:
        return max_num_tokens
    return min(1 << (int(num_tokens) - 1).bit_length(), max_num_tokens)


def linked_token_count(*tensors_and_dims: Any) -> int:
    """The one token count shared by linked inputs: each argument is a tensor (token dim 0) or a
    (tensor, dim) pair for a tensor whose token dimension is elsewhere (e.g. a transposed scale).
    Raises if they disagree: they must all map to the same bucket."""
    counts = []
    for item in tensors_and_dims:
        if item is None:
            continue
        tensor, dim = item if isinstance(item, tuple) else (item, 0)
        counts.append(int(tensor.shape[dim]))
    if not counts:
        raise ValueError("no tensor carries the token count")
    if any(c != counts[0] for c in counts):
        raise ValueError(f"linked inputs disagree on the token count: {counts}")
    return counts[0]


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------

# The source files a tunable kernel is built from: the module of its @triton.jit entry point and
# the modules of the device functions it calls (activations, fp8 rounding, the PDL prologue).
KERNEL_SOURCES = {GROUPED_GEMM: ("grouped_gemm", "common")}
# Modules only some quant modes' builds read (the 4-bit decode): hashed into those modes' kernel
# source alone, so that a change of the 4-bit decode leaves the other modes' tables valid.
QUANT_SOURCES = {GROUPED_GEMM: {"nvfp4": ("fp4_decode",), "mxfp4": ("fp4_decode",)}}


@functools.lru_cache(maxsize=None)
def kernel_source_hash(kernel: str = GROUPED_GEMM, quant: Optional[str] = None) -> str:
    """sha256 (16 hex digits) of the source text of the kernel's modules (KERNEL_SOURCES, and
    QUANT_SOURCES of `quant`): a config tuned for one version of a kernel never silently
    applies to another."""
    import importlib
    digest = hashlib.sha256()
    names = KERNEL_SOURCES.get(kernel, (kernel,)) + QUANT_SOURCES.get(kernel, {}).get(quant, ())
    for name in names:
        module = importlib.import_module(f"moe_ops.kernels.{name}")
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _device_name(index: Optional[int]) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(device: Optional[torch.device] = None) -> str:
    """torch.cuda.get_device_name() for a CUDA device (the current one by default), else "cpu"."""
    if device is not None:
        if device.type != "cuda":
            return "cpu"
        return _device_name(device.index if device.index is not None
                            else torch.cuda.current_device())
    if torch.cuda.is_available():
        return _device_name(torch.cuda.current_device())
    return "cpu"


def _versions() -> Dict[str, str]:
    import moe_ops
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency of the kernels
        triton_version = "none"
    return {"package": "moe_ops", "package_version": getattr(moe_ops, "__version__", "?"),
            "torch": torch.__version__, "triton": triton_version}


@dataclass(frozen=True)
class ProblemKey:
    """Everything that changes the best config of one GEMM, plus the token bucket."""
    kernel: str
    kernel_hash: str
    gemm: int
    num_experts: int        # global E (equal to local_experts without expert parallelism)
    n: int
    k: int
    top_k: int
    quant: str
    activation: str
    gated: bool
    dtype: str
    local_experts: int
    gpu: str
    bucket: int

    def as_str(self) -> str:
        """The canonical string used as the key in the JSON file."""
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @classmethod
    def from_str(cls, text: str) -> "ProblemKey":
        parts = dict(p.split("=", 1) for p in text.split(";"))
        values = {}
        for f in dataclasses.fields(cls):
            raw = parts[f.name]
            if f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("bool", bool):
                if raw not in ("True", "False"):
                    raise ValueError(f"bad bool {raw!r}")
                values[f.name] = raw == "True"
            else:
                values[f.name] = raw
        if set(parts) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"unexpected key fields in {text!r}")
        return cls(**values)

    def problem(self) -> GemmProblem:
        """The GemmProblem at this bucket's token count (what profiling runs)."""
        return GemmProblem(self.gemm, self.local_experts, self.n, self.k,
                           self.bucket * self.top_k / self.local_experts,
                           getattr(torch, self.dtype), self.quant, self.gated)


def problem_key(problem: GemmProblem, *, num_tokens: int, top_k: int, activation: str,
                num_experts: Optional[int] = None, device: Optional[torch.device] = None,
                max_num_tokens: int = TUNE_MAX_NUM_TOKENS,
                kernel: str = GROUPED_GEMM) -> ProblemKey:
    """The key of a grouped-GEMM problem at num_tokens (>= 1) tokens."""
    local = problem.num_experts
    return ProblemKey(
        kernel=kernel, kernel_hash=kernel_source_hash(kernel, problem.quant), gemm=problem.gemm,
        num_experts=local if num_experts is None else num_experts, n=problem.n, k=problem.k,
        top_k=top_k, quant=problem.quant, activation=activation, gated=problem.gated,
        dtype=str(problem.dtype).replace("torch.", ""), local_experts=local,
        gpu=gpu_name(device), bucket=bucket_of(num_tokens, max_num_tokens))


# ---------------------------------------------------------------------------------------------
# Runners, timers, capture predicates
# ---------------------------------------------------------------------------------------------

class Runner(Protocol):
    """Runs one tunable kernel for a key with a given config on profiling inputs."""

    def candidates(self, key: ProblemKey) -> Sequence[GemmConfig]: ...

    def default(self, key: ProblemKey) -> GemmConfig: ...

    def run(self, key: ProblemKey, config: GemmConfig) -> torch.Tensor: ...


Timer = Callable[[Callable[[], Any]], float]   # seconds per call of fn


def cuda_event_timer(fn: Callable[[], Any], warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds per call, timed with CUDA events (the default timer on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


# Bytes written between timed calls to evict the previous call's data from L2 (50 MB on an
# H100/H200): every call starts cold, as it does in a model where the other layers run between
# two calls of this one.
L2_FLUSH_BYTES = 256 << 20
_flush_buffers: Dict[int, torch.Tensor] = {}


def _flush_buffer() -> torch.Tensor:
    index = torch.cuda.current_device()
    buf = _flush_buffers.get(index)
    if buf is None:
        buf = _flush_buffers[index] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return buf


def _replay_seconds(graph: "torch.cuda.CUDAGraph", repeat: int) -> float:
    graph.replay()  # the first replay uploads the graph
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


# Calls longer than this are timed with fewer replays (tuning time of slow prefill buckets).
LONG_CALL_SECONDS = 5e-3


def graph_timer(fn: Callable[[], Any], *, repeat: int = 5, target_seconds: float = 2e-3,
                max_calls: int = 20, cold_l2: bool = True) -> float:
    """Seconds per call of fn, replayed from a CUDA graph (as served: no launch overhead to
    pick the config with the fewest launches) with L2 flushed before every call (so the weights
    come from HBM, not from the previous call). The graph holds enough calls to last about
    target_seconds; the flushes are timed in a graph of their own and subtracted. The median of
    `repeat` replays. Falls back to cuda_event_timer if fn cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile, allocate, warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    estimate = cuda_event_timer(fn, warmup=0, repeat=1)
    if estimate < LONG_CALL_SECONDS:
        estimate = cuda_event_timer(fn, warmup=0, repeat=3)
    else:
        # a long call: its timing varies little, and each replay costs the GPU that long
        repeat = min(repeat, 3)
    calls = max(1, min(max_calls, int(target_seconds / max(estimate, 1e-7))))
    flush = _flush_buffer() if cold_l2 else None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if flush is not None:
                    flush.zero_()
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return cuda_event_timer(fn)
    total = _replay_seconds(graph, repeat)
    del graph
    if flush is None:
        return total / calls
    flush_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(flush_graph):
        for _ in range(calls):
            flush.zero_()
    flushes = _replay_seconds(flush_graph, repeat)
    return max(total - flushes, 0.0) / calls


def wall_timer(fn: Callable[[], Any], warmup: int = 1, repeat: int = 3) -> float:
    """Median wall-clock seconds per call: for CPU runs (the Triton interpreter), where the
    timings mean nothing for a GPU but the tuner's logic can run end to end."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def default_timer() -> Timer:
    """graph_timer on a GPU, wall_timer elsewhere."""
    return graph_timer if torch.cuda.is_available() else wall_timer


def is_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # CPU-only torch
        return False


def is_compiling() -> bool:
    """True while torch.compile traces."""
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - older torch
        return False


def outputs_match(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """A candidate's output against the default config's: same shape, finite, close."""
    if out.shape != ref.shape:
        return False
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return False
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    tol = 2e-2 * max(scale, 1e-6)
    return bool(torch.allclose(out, ref, rtol=2e-2, atol=tol))


# ---------------------------------------------------------------------------------------------
# The cache file
# ---------------------------------------------------------------------------------------------

def _config_to_json(config: GemmConfig) -> Dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(data: Dict[str, Any]) -> GemmConfig:
    fields = dataclasses.fields(GemmConfig)
    names = {f.name for f in fields}
    flags = {f.name for f in fields if f.type in (bool, "bool")}  # the rest are ints
    if not isinstance(data, dict) or set(data) - names:
        raise ValueError(f"not a GemmConfig: {data!r}")
    values = {}
    for name, value in data.items():
        if name in flags:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool")
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int")
        values[name] = value
    return GemmConfig(**values)


def current_metadata(gpu: Optional[str] = None) -> Dict[str, Any]:
    meta = dict(_versions())
    meta["format"] = FORMAT_VERSION
    meta["gpu"] = gpu_name() if gpu is None else gpu
    # (informational: each entry's key carries the hash of its own mode's source, which is
    # what decides whether the entry applies, see _stale_entry)
    meta["kernel_hash"] = {GROUPED_GEMM: kernel_source_hash(GROUPED_GEMM)}
    for quant, names in QUANT_SOURCES[GROUPED_GEMM].items():
        meta["kernel_hash"][f"{GROUPED_GEMM}+{'+'.join(names)}"] = kernel_source_hash(
            GROUPED_GEMM, quant)
    return meta


def _stale_entry(key: "ProblemKey") -> bool:
    """Whether an entry was tuned on another source of its kernel (for its quant mode); an
    entry of a kernel this package does not have is stale too."""
    try:
        return key.kernel_hash != kernel_source_hash(key.kernel, key.quant)
    except ImportError:
        return True


def _metadata_mismatch(meta: Any, expected: Dict[str, Any], fields: Iterable[str]) -> List[str]:
    if not isinstance(meta, dict):
        return ["metadata missing"]
    return [f"{name}: file {meta.get(name)!r}, here {expected[name]!r}"
            for name in fields if meta.get(name) != expected[name]]


# (The kernel source is checked entry by entry, _stale_entry: one file holds several modes.)
_STRICT_FIELDS = ("format", "package", "package_version", "torch", "triton", "gpu")
# Shipped tables are tuned once per GPU; they hold across torch/triton updates as long as the
# kernel source is the same (a config is a launch choice; correctness does not depend on it).
_SHIPPED_FIELDS = ("format", "package", "gpu")


def read_cache_file(path: os.PathLike, *, expected: Optional[Dict[str, Any]] = None,
                    fields: Sequence[str] = _STRICT_FIELDS,
                    warn: bool = True) -> Dict[ProblemKey, GemmConfig]:
    """The usable entries of a cache file. Missing file: empty, silently. Unreadable, corrupt,
    metadata that does not match, or bad entries: one warning, never an exception."""
    path = Path(path)
    if not path.exists():
        return {}
    expected = current_metadata() if expected is None else expected
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        if warn:
            warnings.warn(f"moe_ops tuning cache {path} is unreadable or corrupt, ignored: {exc}",
                          TuningCacheWarning, stacklevel=3)
        return {}
    mismatch = _metadata_mismatch(data.get("metadata"), expected, fields)
    if mismatch:
        if warn:
            warnings.warn(f"moe_ops tuning cache {path}: {len(data['entries'])} entries ignored, "
                          f"metadata does not match ({'; '.join(mismatch)})",
                          TuningCacheWarning, stacklevel=3)
        return {}
    entries, bad, stale = {}, 0, 0
    for text, entry in data["entries"].items():
        try:
            key = ProblemKey.from_str(text)
            config = _config_from_json(entry["config"])
            if key.kernel == GROUPED_GEMM and not is_valid_config(key.problem(), config):
                raise ValueError("config not valid for its problem")
        except (KeyError, ValueError, TypeError, AttributeError):
            bad += 1
            continue
        if _stale_entry(key):
            stale += 1
            continue
        entries[key] = config
    if bad and warn:
        warnings.warn(f"moe_ops tuning cache {path}: {bad} malformed entries ignored",
                      TuningCacheWarning, stacklevel=3)
    if stale and warn:
        warnings.warn(f"moe_ops tuning cache {path}: {stale} entries ignored, tuned on another "
                      f"kernel source (kernel_hash of their keys)",
                      TuningCacheWarning, stacklevel=3)
    return entries


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no fcntl: atomic replace, last writer wins
        yield
        return
    with open(f"{path}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def write_cache_file(path: os.PathLike, entries: Dict[ProblemKey, Dict[str, Any]],
                     metadata: Optional[Dict[str, Any]] = None) -> None:
    """Merge entries into the file under a lock, written atomically (temp file + os.replace).
    Entries of a file whose metadata does not match (or a corrupt file) are dropped."""
    path = Path(path)
    metadata = current_metadata() if metadata is None else metadata
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        merged: Dict[str, Any] = {}
        try:
            old = json.loads(path.read_text())
            if (isinstance(old, dict) and isinstance(old.get("entries"), dict)
                    and not _metadata_mismatch(old.get("metadata"), metadata, _STRICT_FIELDS)):
                for text, entry in old["entries"].items():
                    try:
                        if _stale_entry(ProblemKey.from_str(text)):
                            continue   # tuned on another kernel source: dropped
                    except (KeyError, ValueError, TypeError, AttributeError):
                        pass           # kept as it was (read_cache_file reports it)
                    merged[text] = entry
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        for key, entry in entries.items():
            merged[key.as_str()] = entry
        text = json.dumps({"metadata": metadata, "entries": dict(sorted(merged.items()))},
                          indent=1)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---------------------------------------------------------------------------------------------
# The tuner
# ---------------------------------------------------------------------------------------------

_MISS = object()


class Tuner:
    """The config cache and profiler. One process-wide instance (`get_tuner()`) serves the
    kernels; tests make their own."""

    def __init__(self, shipped_dir: Optional[os.PathLike] = SHIPPED_DIR,
                 max_num_tokens: int = TUNE_MAX_NUM_TOKENS):
        self.shipped_dir = None if shipped_dir is None else Path(shipped_dir)
        self.max_num_tokens = max_num_tokens
        self._lock = threading.RLock()
        self.memory: Dict[ProblemKey, GemmConfig] = {}       # tuned in this process
        self.records: Dict[ProblemKey, Dict[str, Any]] = {}  # ... with their timings
        self.user: Dict[ProblemKey, GemmConfig] = {}         # from the user's cache file
        self._shipped: Optional[Dict[ProblemKey, GemmConfig]] = None
        # key -> config or None (= use the default): one entry per distinct key, whatever the
        # number of calls; cleared whenever a layer changes.
        self._resolved: Dict[ProblemKey, Optional[GemmConfig]] = {}
        self._forced: Dict[int, GemmConfig] = {}              # gemm -> config
        self._tuning_depth = 0
        self.profile_count = 0
        self.timer: Optional[Timer] = None   # None: default_timer() (graph_timer on a GPU)

    # -- layers -------------------------------------------------------------------------------
    @property
    def shipped(self) -> Dict[ProblemKey, GemmConfig]:
        if self._shipped is None:
            tables: Dict[ProblemKey, GemmConfig] = {}
            if self.shipped_dir is not None and self.shipped_dir.is_dir():
                expected = current_metadata()
                for path in sorted(self.shipped_dir.glob("*.json")):
                    # tables of other GPUs are expected there: silently skipped
                    try:
                        gpu = json.loads(path.read_text()).get("metadata", {}).get("gpu")
                    except (OSError, ValueError, AttributeError):
                        gpu = None
                    if gpu is not None and gpu != expected["gpu"]:
                        continue
                    tables.update(read_cache_file(path, expected=expected,
                                                  fields=_SHIPPED_FIELDS))
            self._shipped = tables
        return self._shipped

    def load(self, path: os.PathLike) -> int:
        """Load a user cache file (replacing the previous one's entries); returns the count."""
        entries = read_cache_file(path)
        with self._lock:
            self.user = entries
            self._resolved.clear()
        return len(entries)

    def clear(self) -> None:
        with self._lock:
            self.memory.clear()
            self.records.clear()
            self.user = {}
            self._shipped = None
            self._resolved.clear()
            self._forced.clear()

    def cache_size(self) -> int:
        """Entries held by the lookup memo (bounded by distinct keys, not calls)."""
        return len(self._resolved)

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, key: ProblemKey) -> Optional[GemmConfig]:
        """The tuned config of a key, or None: the caller uses its default heuristic."""
        if self._forced:
            forced = self._forced.get(key.gemm)
            if forced is not None:
                return forced
        hit = self._resolved.get(key, _MISS)
        if hit is not _MISS:
            return hit
        config = self.memory.get(key)
        if config is None:
            config = self.user.get(key)
        if config is None:
            config = self.shipped.get(key)
        with self._lock:
            self._resolved[key] = config
        return config

    def config_for(self, problem: GemmProblem, key: Optional[ProblemKey] = None,
                   runner: Optional[Runner] = None, timer: Optional[Timer] = None) -> GemmConfig:
        """The config to launch with: forced, tuned, profiled now (inside `autotune`, with a
        runner, not capturing or compiling), else default_config(problem)."""
        if key is not None:
            forced = self._forced.get(key.gemm) if self._forced else None
            if forced is not None:
                if not is_valid_config(problem, forced):
                    raise ValueError(f"forced config {forced} is not valid for {problem}")
                return forced
            config = self.lookup(key)
            if config is None and runner is not None and self.may_profile():
                config = self.tune(key, runner, timer)
            if config is not None:
                return config
        return default_config(problem)

    # -- the public API of SPEC §6 ------------------------------------------------------------
    @staticmethod
    def valid_configs(problem: GemmProblem, prune: bool = True) -> List[GemmConfig]:
        return config_space(problem, prune=prune)

    @staticmethod
    def default(problem: GemmProblem) -> GemmConfig:
        return default_config(problem)

    def set_forced(self, gemm: int, config: Optional[GemmConfig]) -> None:
        with self._lock:
            if config is None:
                self._forced.pop(gemm, None)
            else:
                self._forced[gemm] = config

    # -- profiling ----------------------------------------------------------------------------
    @property
    def tuning(self) -> bool:
        return self._tuning_depth > 0

    def may_profile(self) -> bool:
        return self.tuning and not is_capturing() and not is_compiling()

    def tune(self, key: ProblemKey, runner: Runner, timer: Optional[Timer] = None,
             progress: Optional[Callable[[int, int], None]] = None,
             deadline: Optional[float] = None) -> Optional[GemmConfig]:
        """Profile the runner's candidates for key; store and return the fastest whose output
        matches the default config's. None (nothing stored) when profiling is not allowed now.
        progress(done, total) is called after each candidate. deadline (time.perf_counter()):
        candidates left when it passes are not profiled (the default always is; the record
        counts them as "skipped")."""
        if not self.may_profile():
            return None
        timer = default_timer() if timer is None else timer
        default = runner.default(key)
        reference = runner.run(key, default)
        best, best_time = default, timer(lambda: runner.run(key, default))
        default_time, tried, rejected, skipped = best_time, 0, 0, 0
        candidates = [c for c in runner.candidates(key) if c != default]
        for done, config in enumerate(candidates):
            if progress is not None and done:
                progress(done, len(candidates))
            if deadline is not None and time.perf_counter() >= deadline:
                skipped = len(candidates) - done
                break
            tried += 1
            try:
                if not outputs_match(runner.run(key, config), reference):
                    rejected += 1
                    continue
                seconds = timer(lambda c=config: runner.run(key, c))
            except Exception:  # a config that fails to compile or launch never wins
                rejected += 1
                continue
            if seconds < best_time:
                best, best_time = config, seconds
        if progress is not None:
            progress(len(candidates), len(candidates))
        with self._lock:
            self.profile_count += 1
            self.memory[key] = best
            self.records[key] = {"config": _config_to_json(best), "us": best_time * 1e6,
                                 "default_us": default_time * 1e6, "candidates": tried,
                                 "rejected": rejected, "skipped": skipped}
            self._resolved.pop(key, None)
        return best

    def save(self, path: os.PathLike) -> None:
        """Merge this process's tuned entries into a cache file (atomic, locked)."""
        with self._lock:
            records = dict(self.records)
        write_cache_file(path, records)


_TUNER: Optional[Tuner] = None
_TUNER_LOCK = threading.Lock()


def get_tuner() -> Tuner:
    global _TUNER
    if _TUNER is None:
        with _TUNER_LOCK:
            if _TUNER is None:
                _TUNER = Tuner()
    return _TUNER


@contextlib.contextmanager
def autotune(cache: Optional[os.PathLike] = None, *, tuner: Optional[Tuner] = None,
             enabled: bool = True) -> Iterator[Tuner]:
    """Inside: misses are profiled (see Tuner.config_for). cache: a JSON file read on entry
    (its entries join the lookups; they stay loaded after exit) and written atomically on exit
    with everything tuned in this process."""
    tuner = get_tuner() if tuner is None else tuner
    if cache is not None:
        tuner.load(cache)
    if enabled:
        tuner._tuning_depth += 1
    try:
        yield tuner
    finally:
        if enabled:
            tuner._tuning_depth -= 1
        if cache is not None and tuner.records:
            try:
                tuner.save(cache)
            except OSError as exc:
                warnings.warn(f"moe_ops tuning cache {cache} could not be written: {exc}",
                              TuningCacheWarning, stacklevel=3)


def load_cache(path: os.PathLike, tuner: Optional[Tuner] = None) -> int:
    """Use a cache file's entries for lookups without tuning."""
    return (get_tuner() if tuner is None else tuner).load(path)


@contextlib.contextmanager
def force_config(gemm1: Optional[GemmConfig] = None, gemm2: Optional[GemmConfig] = None, *,
                 tuner: Optional[Tuner] = None) -> Iterator[None]:
    """Launch every GEMM1 / GEMM2 (without an explicit config) with these configs."""
    tuner = get_tuner() if tuner is None else tuner
    with tuner._lock:
        saved = dict(tuner._forced)
    try:
        if gemm1 is not None:
            tuner.set_forced(1, gemm1)
        if gemm2 is not None:
            tuner.set_forced(2, gemm2)
        yield
    finally:
        with tuner._lock:
            tuner._forced = saved


def valid_configs(problem: GemmProblem, prune: bool = True) -> List[GemmConfig]:
    return config_space(problem, prune=prune)


def experts_candidates(problem: GemmProblem) -> List[GemmConfig]:
    """The configs profiled for one GEMM of a triton_experts call: the kernel's short list
    (tuning_candidates; config_space is the whole space). Tests patch this."""
    return tuning_candidates(problem)


class _CallRunner:
    """Profiles one GEMM of a triton_experts call on the call's own inputs, the other GEMM at
    its current config; the output compared is the whole experts output."""

    def __init__(self, problem: GemmProblem, run: Callable[[GemmConfig], torch.Tensor]):
        self.problem, self._run = problem, run

    def candidates(self, key: ProblemKey) -> Sequence[GemmConfig]:
        return experts_candidates(self.problem)

    def default(self, key: ProblemKey) -> GemmConfig:
        return default_config(self.problem)

    def run(self, key: ProblemKey, config: GemmConfig) -> torch.Tensor:
        return self._run(config)


def experts_keys(problem1: GemmProblem, problem2: GemmProblem, *, num_tokens: int, top_k: int,
                 activation: str, device: Optional[torch.device] = None,
                 max_num_tokens: int = TUNE_MAX_NUM_TOKENS):
    """The keys of a triton_experts call's GEMM1 and GEMM2 (they differ in gemm, n and k)."""
    key1 = problem_key(problem1, num_tokens=num_tokens, top_k=top_k, activation=activation,
                       device=device, max_num_tokens=max_num_tokens)
    return key1, dataclasses.replace(key1, gemm=2, n=problem2.n, k=problem2.k)


def experts_configs(problem1: GemmProblem, problem2: GemmProblem, *, num_tokens: int,
                    top_k: int, activation: str, device: Optional[torch.device] = None,
                    profile: Optional[Callable[[GemmConfig, GemmConfig], torch.Tensor]] = None,
                    tuner: Optional[Tuner] = None):
    """The GEMM1 and GEMM2 configs of one triton_experts call (the hook). profile(c1, c2) runs
    the call with explicit configs; it is used only inside `autotune`, when not capturing or
    compiling, for keys not tuned yet: GEMM1 first (GEMM2 at its current config), then GEMM2
    (GEMM1 at its new one), since the dispatch tile max(block_m) is a joint choice."""
    tuner = get_tuner() if tuner is None else tuner
    profiling = profile is not None and tuner.may_profile()
    if not profiling and not (tuner._forced or tuner.memory or tuner.user or tuner.shipped):
        return default_config(problem1), default_config(problem2)  # nothing tuned: as before
    key1, key2 = experts_keys(problem1, problem2, num_tokens=num_tokens, top_k=top_k,
                              activation=activation, device=device,
                              max_num_tokens=tuner.max_num_tokens)
    runner1 = None
    if profiling:
        now2 = tuner.lookup(key2) or default_config(problem2)
        runner1 = _CallRunner(problem1, lambda c: profile(c, now2))
    config1 = tuner.config_for(problem1, key1, runner1, tuner.timer)
    runner2 = _CallRunner(problem2, lambda c: profile(config1, c)) if profiling else None
    return config1, tuner.config_for(problem2, key2, runner2, tuner.timer)


__all__ = [
    "ProblemKey", "Runner", "TUNE_MAX_NUM_TOKENS", "Tuner", "TuningCacheWarning", "autotune",
    "bucket_of", "current_metadata", "experts_candidates", "experts_configs", "experts_keys",
    "force_config", "get_tuner",
    "is_capturing", "is_compiling", "kernel_source_hash", "linked_token_count", "load_cache",
    "problem_key", "read_cache_file", "token_buckets", "valid_configs", "write_cache_file",
]
