"""What the test workers share: process and platform setup, pass/fail records with their output lines, bit-exact
comparison and placement of host arrays on a mesh.

A worker runs as a script, so this module is imported as ``_harness`` (the script's folder is on ``sys.path``).
Call :func:`start` before anything starts a JAX backend; the rest is imported lazily or only needs numpy.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[2]
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F16 = np.dtype(np.float16)


# ------------------------------------------------------------------------------------------ process setup
def thread_names() -> dict[str, str]:
    """This process's OS threads: tid -> name (``/proc/self/task/<tid>/comm``)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[tid] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
    return out


def threads_named(name: str) -> int:
    """How many of this process's OS threads are named ``name`` (the native module names its own)."""
    return sum(1 for n in thread_names().values() if n == name)


def thread_cpu_seconds(name: str) -> float:
    """CPU time (user + system, seconds) used so far by this process's OS threads named ``name``
    (``/proc/self/task/<tid>/stat``, in clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for tid, n in thread_names().items():
        if n != name:
            continue
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / tick


def import_launch():
    """``jax_engram.launch``; from the source checkout when jax_engram is not installed."""
    try:
        from jax_engram import launch
    except ModuleNotFoundError as e:
        if e.name not in ("jax_engram", "jax_engram.launch"):
            raise
        sys.path.insert(0, str(REPO))
        from jax_engram import launch
    return launch


def start(platform: str = "auto", cpu_devices: int | None = None, **initialize_kw):
    """Joins the launcher's job (``jax_engram.launch.initialize``: call it before anything starts a JAX backend)
    and returns its config, or None for a standalone run. A standalone run picks its platform: "cpu" (with
    ``cpu_devices`` CPU devices), "cuda" or "gpu" (CUDA, with the CPU platform kept too), "auto" (JAX's
    choice); under the launcher the launcher has chosen."""
    cfg = import_launch().initialize(**initialize_kw)
    import jax

    if cfg is None:
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        elif platform in ("gpu", "cuda"):
            jax.config.update("jax_platforms", "cuda,cpu")  # cpu: host arrays of the checks
    return cfg


def load_example(name: str = "moe_layer"):
    """The module of examples/<name>.py (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ pass / fail
class Checks:
    """Pass/fail record of one worker run ({name: passed}, in run order) and the line each check prints.

    ``style="CHECK"``: ``CHECK <name> PASS|FAIL [(<s>s)] <detail>`` (the detail, with the traceback of an
    exception, only on failure); ``style="PASS"``: ``PASS <name> (<s>s)`` or ``FAIL <name>: <error>``, the
    traceback on stderr. ``decimals``: the seconds printed (None: no time; the PASS style always prints it).
    ``select``: which names :meth:`case` runs (default: all)."""

    def __init__(self, style: str = "CHECK", decimals: int | None = None, select=None):
        assert style in ("CHECK", "PASS"), style
        self.style, self.select = style, select
        self.decimals = 1 if decimals is None and style == "PASS" else decimals
        self.results: dict[str, bool] = {}
        self.errors: dict[str, str] = {}   # name -> "<Type>: <message>" of a failed check
        self.times: dict[str, float] = {}  # name -> seconds

    def run(self, name: str, fn) -> bool:
        """fn() returns (ok, detail); an exception fails the check."""
        t = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - report every failure
            return self._failed(name, t, e)
        return self._record(name, t, bool(ok), detail)

    def expect(self, name: str, fn) -> bool:
        """fn() passes unless it raises (assert-style checks)."""
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report every failure
            return self._failed(name, t, e)
        return self._record(name, t, True, "")

    def case(self, name: str):
        """Decorator form of :meth:`expect`: runs the function at once, if ``select`` admits the name."""
        def deco(fn):
            if self.select is None or self.select(name):
                self.expect(name, fn)
            return fn
        return deco

    def _failed(self, name, t, e):
        self.errors[name] = f"{type(e).__name__}: {e}"
        if self.style == "PASS":
            ok = self._record(name, t, False, self.errors[name])
            traceback.print_exc()
            return ok
        return self._record(name, t, False, f"{self.errors[name]}\n{traceback.format_exc()}")

    def _record(self, name, t, ok, detail):
        dt = time.perf_counter() - t
        self.results[name] = ok
        self.times[name] = round(dt, 3)
        if self.style == "PASS":
            line = f"PASS {name} ({dt:.{self.decimals}f}s)" if ok else f"FAIL {name}: {detail}"
        else:
            took = "" if self.decimals is None else f" ({dt:.{self.decimals}f}s)"
            line = f"CHECK {name} {'PASS' if ok else 'FAIL'}{took} {detail if not ok else ''}".rstrip()
        print(line, flush=True)
        return ok

    @property
    def passed(self) -> list[str]:
        return [k for k, v in self.results.items() if v]

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.results.items() if not v]

    def summary(self, worker: str, *details: str, failed_sep: str = " FAILED: ") -> None:
        """Prints ``SUMMARY <worker>: N passed, M failed (<details>)<failed_sep><failed names>`` (other tools
        grep this line)."""
        failed = self.failed
        print(f"SUMMARY {worker}: {len(self.passed)} passed, {len(failed)} failed ({', '.join(details)})"
              f"{failed_sep + ', '.join(failed) if failed else ''}", flush=True)


def expect_error(fn, *needles) -> tuple[bool, str]:
    """(ok, detail) of calling fn: ok when it raises an error whose message contains every needle."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        return not missing, f"missing {missing} in: {msg[:600]}"
    return False, "no error raised"


def raises(fn, exc, *needles) -> None:
    """Asserts that fn() raises exc with every needle in its message."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{exc.__name__} message lacks {n!r}: {msg}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected {exc.__name__} mentioning {needles}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc.__name__} mentioning {needles}, nothing raised")


# ------------------------------------------------------------------------------------------ bits
def _uint(dt):
    return np.dtype(f"u{np.dtype(dt).itemsize}")


def bits(a):
    """Floating arrays (and bfloat16 / float8) as unsigned ints of their width, other arrays unchanged: a
    bit-exact, NaN-safe comparison that still compares integers by value."""
    a = np.asarray(a)
    if a.dtype.kind in "fV" or a.dtype.name in ("bfloat16", "float8_e4m3fn"):
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    return a


def raw_bits(a):
    """Every element of 1, 2, 4 or 8 bytes (booleans excepted) as the unsigned int of its bits."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(_uint(a.dtype)) if a.dtype.itemsize in (1, 2, 4, 8) and a.dtype != np.bool_ else a


def same(a, b) -> bool:
    """Same shape and the same bits (see :func:`bits`)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def assert_same(got, want, what: str) -> None:
    """Raises AssertionError unless ``got`` has ``want``'s shape and bits (:func:`raw_bits`). ``got``: a global
    jax.Array, compared shard by shard on this process's devices (``want``: the full host value), or a host
    array. The message names the first differing element."""
    want = np.asarray(want)
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)} != reference {want.shape}"
    pieces = ([(s.data, want[s.index], f"{s.device} (shard {s.index})") for s in got.addressable_shards]
              if hasattr(got, "addressable_shards") else [(got, want, "host")])
    for g, w, where in pieces:
        g, w = raw_bits(g), raw_bits(w)
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            first = tuple(bad[0])
            raise AssertionError(f"{what}: {len(bad)} of {g.size} elements differ on {where}, first at "
                                 f"{list(first)}: got {g[first]:#x}, want {w[first]:#x}")


def random_bits(rng, shape, dt):
    """Random bit patterns of dtype dt without NaNs or infinities (reference.engram_lookup canonicalises NaN
    payloads on XLA:CPU), so any value conversion in an op shows up as a bit mismatch."""
    dt = np.dtype(dt)
    u = rng.integers(0, 2 ** (8 * dt.itemsize), size=shape, dtype=np.uint64).astype(_uint(dt))
    if dt == FP8:
        u = np.where((u & 0x7F) == 0x7F, u ^ 0x01, u)
    else:
        exp = {2: 0x7C00 if dt == F16 else 0x7F80, 4: 0x7F800000}[dt.itemsize]
        hi = {2: 0x4000, 4: 0x40000000}[dt.itemsize]
        u = np.where((u & exp) == exp, u & ~np.array(hi, u.dtype), u)
    return u.astype(_uint(dt)).view(dt)


def make_ids(seed, rows, E, total, special=True):
    """[rows, E] int32 Engram ids over a table of total entries: uniform valid ids plus (special=True) padding
    (-1, -7), out-of-range ids (total, total+5, 2**31-1) and the edges (0, total-1). seed: an int or a
    numpy Generator (used as is)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, total, size=(rows, E), dtype=np.int64)
    if special:
        pool = np.array([-1, -7, total, total + 5, 2**31 - 1, 0, total - 1], np.int64)
        mask = rng.random((rows, E)) < 0.3
        ids = np.where(mask, pool[rng.integers(0, len(pool), size=(rows, E))], ids)
    return ids.astype(np.int32)


# ------------------------------------------------------------------------------------------ placement
def group_meshes(devices) -> dict:
    """The same devices as both group shapes the args checks compare: ``{"flat": (mesh, "ep"), "hier": (mesh,
    ("node", "gpu"))}``, the second with 2 nodes (explicit axes)."""
    import jax

    explicit = jax.sharding.AxisType.Explicit
    devs = np.array(devices)
    return {"flat": (jax.sharding.Mesh(devs, ("ep",), axis_types=(explicit,)), "ep"),
            "hier": (jax.sharding.Mesh(devs.reshape(2, -1), ("node", "gpu"), axis_types=(explicit, explicit)),
                     ("node", "gpu"))}


def shard(a, mesh, spec):
    """The global jax array of host array a (the same in every process) placed on mesh by spec; each process
    builds only its own shards."""
    import jax
    from jax.sharding import NamedSharding

    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def local(arr):
    """{rank: numpy block} for the ranks this process owns (arr is [R, ...] sharded on axis 0)."""
    return {s.index[0].start or 0: np.asarray(s.data)[0] for s in arr.addressable_shards}
