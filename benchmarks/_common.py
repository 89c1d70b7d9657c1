"""Timing and reporting helpers shared by the jax_engram benchmark scripts.

Everything here works on any JAX backend (CPU with forced host devices for tests, 1-8 GPUs for
real runs) and makes no assumption about the device count beyond >= 1.

Timing rules (see METHOD.md of the device workplace):
  * device work is asynchronous: every sample ends with ``jax.block_until_ready`` on the outputs
    before the host clock is read;
  * warm up first (compilation, NCCL communicator creation and autotuning stay out of the numbers);
  * report the median (and p10/p90) of many samples, never a single run;
  * for us-scale ops, per-call host dispatch (~10-50 us) dominates: use ``time_loop``, which runs
    the op ``n`` times inside one jitted ``lax.fori_loop`` and divides, or ``time_per_call``, which
    takes the slope between two loop lengths (removes the program's fixed overhead exactly);
  * if the inputs fit in L2 (50 MiB on H200), rotate among several input sets (``rotate``).

Imports of this module never touch a device; only the functions do.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = [
    "time_fn", "time_back_to_back", "time_interleaved", "time_loop", "time_per_call", "rotate", "rotations_for_cache",
    "Table", "print_table", "write_json", "config_line", "env_info", "make_ep_mesh", "gbps", "mpps", "fmt_value", "H200_L2_BYTES",
]

# H200 (GH100 die) L2 cache: 50 MiB. Inputs smaller than about twice this must be rotated.
H200_L2_BYTES = 50 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def _as_tuple(a) -> tuple:
    return a if isinstance(a, tuple) else (a,)


def _summarize(samples_us: list[float], **extra) -> dict:
    s = sorted(samples_us)
    q = lambda p: float(np.percentile(s, p)) if s else float("nan")  # noqa: E731
    out = dict(median_us=q(50), p10_us=q(10), p90_us=q(90), min_us=float(s[0]) if s else float("nan"),
               mean_us=float(statistics.fmean(s)) if s else float("nan"), samples=[float(x) for x in samples_us])
    out.update(extra)
    return out


def _call_sets(args: tuple, arg_sets: Sequence[tuple] | None) -> list[tuple]:
    """The argument tuples the timers cycle through: ``arg_sets``, or the one tuple ``args``."""
    if arg_sets is None:
        return [args]
    sets = [_as_tuple(a) for a in arg_sets]
    if not sets:
        raise ValueError("arg_sets is empty")
    if args:
        raise ValueError("pass either positional args or arg_sets, not both")
    return sets


def time_fn(fn: Callable, *args, warmup: int = 3, iters: int = 20, inner: int = 1,
            arg_sets: Sequence[tuple] | None = None) -> dict:
    """Time ``fn(*args)`` (normally a jitted function) per call with the host wall clock.

    Each sample is: read clock, call, ``jax.block_until_ready`` on the outputs, read clock. The
    first ``warmup`` calls (at least one, which compiles) are discarded. ``inner`` is the number of
    repetitions ``fn`` performs internally (e.g. a ``lax.fori_loop``); every sample is divided by it.

    ``arg_sets``: optional list of argument tuples (see ``rotate``); call ``i`` (warm-up calls counted) then uses
    ``arg_sets[i % len(arg_sets)]`` instead of ``args``, so repeated calls do not run out of cache.

    Returns ``dict(median_us, p10_us, p90_us, min_us, mean_us, samples, iters, warmup, inner)``, all
    per-iteration microseconds.
    """
    sets = _call_sets(args, arg_sets)
    inner = max(int(inner), 1)
    w = max(int(warmup), 1)
    for i in range(w):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    samples = []
    for i in range(w, w + int(iters)):  # the count goes on from the warm-up: no timed call repeats the last set
        a = sets[i % len(sets)]
        t0 = time.perf_counter()
        out = fn(*a)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e6 / inner)
        del out
    return _summarize(samples, iters=int(iters), warmup=max(int(warmup), 1), inner=inner)


def time_back_to_back(fn: Callable, *args, steps: int = 10, warmup: int = 2, iters: int = 5,
                      arg_sets: Sequence[tuple] | None = None) -> dict:
    """Per-call time of ``fn(*args)`` dispatched ``steps`` times back to back, as a training or serving loop
    runs: the host enqueues call i+1 while the device runs call i, and only the last is waited for. Host-side
    costs (dispatch, the custom calls' enqueueing) then overlap the device's work instead of adding to each call,
    as they do in ``time_fn``. ``arg_sets``: as in ``time_fn`` (call i of the whole run uses set i mod k).
    Returns ``time_fn``'s dict (per call)."""
    sets = _call_sets(args, arg_sets)
    steps = max(int(steps), 1)
    calls = 0
    for _ in range(max(int(warmup), 1)):
        jax.block_until_ready(fn(*sets[calls % len(sets)]))
        calls += 1
    samples = []
    for _ in range(int(iters)):
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
            out = fn(*sets[calls % len(sets)])
            calls += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e6 / steps)
        del out
    return _summarize(samples, iters=int(iters), warmup=max(int(warmup), 1), inner=steps)


def time_interleaved(fns: dict[str, Callable], *, arg_sets: Sequence[tuple], warmup: int = 1, iters: int = 10,
                     steps: int = 1) -> dict[str, dict]:
    """Times several functions against each other, interleaved call by call: sample i runs every function once, on
    the same argument set (``arg_sets[i mod k]``), in an order that rotates with i. A drift of the machine over the
    run (GPU clocks, host load, a neighbour) then falls on every function alike, and sample i of one function pairs
    with sample i of another, where timing each function's samples in a block of its own lets the drift settle into
    the comparison.

    ``steps == 1``: a sample is one call timed to its end (as ``time_fn``); ``steps > 1``: ``steps`` calls
    dispatched back to back and waited for once, per call (as ``time_back_to_back``). Each function first runs
    ``warmup`` (at least one) calls, which compile. A function that raises is dropped from the rest of the run.
    Returns, per name, ``time_fn``'s dict, or ``{"error": "Type: message"}``.
    """
    sets = _call_sets((), arg_sets)
    names = list(fns)
    steps = max(int(steps), 1)
    errors: dict[str, str] = {}
    samples: dict[str, list[float]] = {n: [] for n in names}

    def run(name: str, first_set: int, timed: bool) -> None:
        if name in errors:
            return
        try:
            t0 = time.perf_counter()
            out = None
            for j in range(steps):
                out = fns[name](*sets[(first_set + j) % len(sets)])
            jax.block_until_ready(out)
            if timed:
                samples[name].append((time.perf_counter() - t0) * 1e6 / steps)
            del out
        except Exception as e:  # noqa: BLE001 - one failing function must not lose the others
            errors[name] = f"{type(e).__name__}: {str(e)[:400]}"

    w = max(int(warmup), 1)
    for name in names:
        for i in range(w):
            run(name, i * steps, False)
    for i in range(int(iters)):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            run(name, (w + i) * steps, True)
    return {n: {"error": errors[n]} if n in errors else
            _summarize(samples[n], iters=int(iters), warmup=w, inner=steps) for n in names}


def time_loop(step_fn: Callable, carry: Any, n: int, *, warmup: int = 2, iters: int = 10) -> dict:
    """Per-iteration time of ``step_fn`` run ``n`` times back to back on the device.

    Builds ``jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step_fn(c), c))`` and times one call
    of it with ``time_fn(..., inner=n)``: host dispatch is paid once per ``n`` steps, so this is the
    right way to time us-scale ops. ``step_fn`` must map the carry (any pytree) to a carry of the
    same structure/shape/dtype/sharding, and its output must depend on its input, otherwise XLA may
    hoist the work out of the loop. A typical step for a collective is
    ``lambda c: op(c)`` or ``lambda c: (op(c[0], c[1]), c[1])``.

    Returns the ``time_fn`` dict plus ``n``.
    """
    n = int(n)
    if n < 1:
        raise ValueError("n must be >= 1")
    looped = jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step_fn(c), c))
    res = time_fn(looped, carry, warmup=warmup, iters=iters, inner=n)
    res["n"] = n
    return res


def time_per_call(make: Callable[[int], Callable], args: tuple, n1: int, n2: int, *, warmup: int = 2,
                  iters: int = 10) -> dict:
    """Per-call device time of an op from the slope of two loop lengths: ``make(n)`` returns a jitted function
    of ``args`` that runs the op ``n`` times back to back (a ``lax.fori_loop``, calls chained by a data
    dependency); per call = (T(n2) - T(n1)) / (n2 - n1), each T the median of ``iters`` host-timed runs.

    Why a slope: one jitted program on several GPUs costs ~0.5-1 ms of fixed overhead (host dispatch, the
    program's first kernel, the final synchronisation) that a loop of n calls divides by n only partly (at
    n = 20 it added ~40-50 us to a 270 us op); the difference of two lengths removes it exactly. Samples of the
    two lengths alternate, so slow drift hits both.

    Returns ``dict(median_us (per call), n1, n2, t1_us, t2_us, per_call_us_n2)``: ``per_call_us_n2`` is the old
    estimate T(n2) / n2 (fixed overhead included), for comparison.
    """
    n1, n2 = int(n1), int(n2)
    if not 1 <= n1 < n2:
        raise ValueError(f"need 1 <= n1 < n2, got {n1}, {n2}")
    f1, f2 = make(n1), make(n2)
    for _ in range(max(int(warmup), 1)):
        jax.block_until_ready(f1(*args))
        jax.block_until_ready(f2(*args))
    s1, s2 = [], []
    for _ in range(int(iters)):
        for f, s in ((f1, s1), (f2, s2)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            s.append((time.perf_counter() - t0) * 1e6)
    t1, t2 = float(np.median(s1)), float(np.median(s2))
    slope_ok = t2 > t1  # noise larger than the work (tiny CPU smoke runs): fall back to T(n2) / n2
    # spread: the slopes of the alternating (n1, n2) sample pairs
    pairs = (np.asarray(s2) - np.asarray(s1)) / (n2 - n1) if slope_ok else np.asarray(s2) / n2
    return dict(median_us=(t2 - t1) / (n2 - n1) if slope_ok else t2 / n2, slope_ok=slope_ok, n1=n1, n2=n2,
                p10_us=float(np.percentile(pairs, 10)), p90_us=float(np.percentile(pairs, 90)),
                t1_us=t1, t2_us=t2, per_call_us_n2=t2 / n2, samples_n1=s1, samples_n2=s2)


def time_loop_per_call(step_fn: Callable, carry: Any, n: int, *, warmup: int = 2, iters: int = 10,
                       compiler_options: dict | None = None) -> dict:
    """``time_loop``'s loop (``step_fn`` on the carry, ``n`` and ``3n`` times in one jitted ``lax.fori_loop``),
    timed per step by ``time_per_call``'s slope: the program's fixed overhead cancels instead of adding
    overhead / n to every step. Same contract for ``step_fn`` as ``time_loop``; ``compiler_options`` go to
    ``jax.jit`` (XLA debug options by name)."""
    n = max(int(n), 1)

    def make(m):
        return jax.jit(lambda c: lax.fori_loop(0, m, lambda i, c: step_fn(c), c), compiler_options=compiler_options)
    return time_per_call(make, (carry,), n, 3 * n, warmup=warmup, iters=iters)


def device_kernel_us(fn: Callable, args: tuple, pattern: str, calls: int = 2) -> dict | None:
    """The device time of the kernels whose name matches ``pattern`` (a regex) while ``fn(*args)`` runs ``calls``
    times, read from a ``jax.profiler`` trace (CUPTI's kernel records): ``dict(median_us, p10_us, p90_us, n,
    kernels)``. This is the kernels' own duration, beside whatever else the device runs (a step time also holds
    launch gaps and the other streams' tail). None where the trace has no device kernels (CPU) or the profiler
    fails."""
    import glob
    import gzip
    import json
    import shutil
    import tempfile
    jax.block_until_ready(fn(*args))  # compiled and warm outside the trace
    folder = tempfile.mkdtemp(prefix="jax_engram_prof_")
    try:
        with jax.profiler.trace(folder):
            for _ in range(max(int(calls), 1)):
                jax.block_until_ready(fn(*args))
        durations, names = [], set()
        rx = re.compile(pattern)
        for f in glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True):
            with gzip.open(f) as fh:
                trace = json.load(fh)
            events = trace["traceEvents"] if isinstance(trace, dict) else trace
            streams = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") ==
                       "thread_name" and "Stream" in str(e.get("args", {}).get("name", ""))}
            for e in events:
                if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams and rx.search(e.get("name", "")):
                    durations.append(float(e["dur"]))
                    names.add(e["name"][:80])
    except Exception:  # noqa: BLE001 - a missing profiler plugin must not lose the benchmark
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not durations:
        return None
    d = np.sort(np.asarray(durations))
    return dict(median_us=float(np.median(d)), p10_us=float(np.percentile(d, 10)),
                p90_us=float(np.percentile(d, 90)), n=int(d.size), kernels=sorted(names)[:4])


def rotate(make_inputs: Callable[[int], Any], k: int) -> list[tuple]:
    """Build ``k`` independent input sets, ``make_inputs(i)`` for i in 0..k-1 (``i`` is the seed).

    Pass the result as ``time_fn(fn, arg_sets=rotate(make, k))``: consecutive calls then read
    different buffers, so a working set that fits in L2 does not flatter the timing. Each set is
    returned as a tuple of arguments. The inputs are made ready before returning.
    """
    sets = [_as_tuple(make_inputs(i)) for i in range(max(int(k), 1))]
    jax.block_until_ready(sets)
    return sets


def rotations_for_cache(bytes_per_set: int, cache_bytes: int = H200_L2_BYTES, factor: float = 2.0,
                        max_sets: int = 64) -> int:
    """How many input sets ``rotate`` needs so the sets together exceed ``factor`` x the cache."""
    if bytes_per_set <= 0:
        return 1
    return int(min(max_sets, max(1, math.ceil(factor * cache_bytes / bytes_per_set) + 1)))


# --------------------------------------------------------------------------------------------
# units
# --------------------------------------------------------------------------------------------
def gbps(nbytes: float | None, us: float | None) -> float | None:
    """GB/s (1e9 bytes per second) for ``nbytes`` moved in ``us`` microseconds."""
    if nbytes is None or us is None or not us or not math.isfinite(us):
        return None
    return nbytes / (us * 1e-6) / 1e9


def mpps(rows: float | None, us: float | None) -> float | None:
    """Millions of rows (packets) per second."""
    if rows is None or us is None or not us or not math.isfinite(us):
        return None
    return rows / (us * 1e-6) / 1e6


# --------------------------------------------------------------------------------------------
# environment / config
# --------------------------------------------------------------------------------------------
def make_ep_mesh(num_devices: int | None = None, axis_name: str = "ep"):
    """1-D mesh over the first ``num_devices`` devices (default: all) with an Explicit axis."""
    devs = jax.devices()
    r = len(devs) if num_devices is None else int(num_devices)
    if r < 1 or r > len(devs):
        raise ValueError(f"asked for {r} devices, {len(devs)} available")
    return jax.make_mesh((r,), (axis_name,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=devs[:r])


def env_info() -> dict:
    """Backend, devices, SM count and versions, for the record of every benchmark run."""
    devs = jax.devices()
    d0 = devs[0]
    try:
        import jaxlib
        jaxlib_version = getattr(jaxlib, "__version__", None)
    except Exception:  # pragma: no cover
        jaxlib_version = None
    info = dict(
        jax=jax.__version__, jaxlib=jaxlib_version, python=platform.python_version(),
        backend=jax.default_backend(), platform=d0.platform, devices=len(devs),
        device_kind=getattr(d0, "device_kind", None),
        sms=getattr(d0, "core_count", None),  # SM count on CUDA devices; None elsewhere
        host=platform.node(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )
    return info


def _cfg_value(v) -> str:
    if v is None or isinstance(v, (str, bool, int, float)):
        return str(v)
    try:
        return np.dtype(v).name  # jnp.bfloat16, np.float32, "bfloat16", dtype objects
    except (TypeError, ValueError):
        return str(v)


def config_line(print_it: bool = True, **kw) -> str:
    """One line stating the configuration of a measurement (METHOD: every number needs one).

    Pass the workload parameters as keywords (tokens=, hidden=, topk=, experts=, dtype=, ...);
    the line adds devices, device kind, SMs per device and the jax version. Returns the line.
    """
    info = env_info()
    fields = dict(kw)
    for k in ("devices", "device_kind", "sms", "backend", "jax"):
        fields.setdefault(k, info[k])
    parts = [f"{k}={_cfg_value(v)}" for k, v in fields.items()]
    line = "config: " + " ".join(parts)
    if print_it:
        print(line, flush=True)
    return line


# --------------------------------------------------------------------------------------------
# tables / json
# --------------------------------------------------------------------------------------------
def fmt_value(v: Any, fmt: str | None = None) -> str:
    if v is None:
        return "n/a"
    if fmt is not None:
        try:
            return format(v, fmt)
        except (TypeError, ValueError):
            return str(v)
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return "n/a" if math.isnan(v) else str(v)
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.1f}"
        return f"{v:.3g}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}" if abs(int(v)) >= 10000 else str(int(v))
    return str(v)


class Table:
    """Plain-text table. ``columns`` items are names or ``(key, header)`` / ``(key, header, fmt)``.

    >>> t = Table(["name", ("median_us", "us", ".1f")]); t.add(name="x", median_us=3.14159)
    >>> print(t.render())
    """

    def __init__(self, columns: Sequence[Any], title: str | None = None):
        self.cols = []
        for c in columns:
            if isinstance(c, str):
                self.cols.append((c, c, None))
            else:
                c = tuple(c)
                self.cols.append((c[0], c[1] if len(c) > 1 else c[0], c[2] if len(c) > 2 else None))
        self.title = title
        self.rows: list[dict] = []

    def add(self, row: dict | None = None, **kw) -> "Table":
        r = dict(row or {})
        r.update(kw)
        self.rows.append(r)
        return self

    add_row = add

    def render(self) -> str:
        head = [h for _, h, _ in self.cols]
        body = [[fmt_value(r.get(k), f) for k, _, f in self.cols] for r in self.rows]
        widths = [max([len(head[i])] + [len(b[i]) for b in body]) for i in range(len(head))]

        # right-align columns holding only numbers (or n/a), left-align the rest
        numeric = [all(isinstance(r.get(k), (int, float, np.integer, np.floating)) and not isinstance(r.get(k), bool)
                       or r.get(k) is None for r in self.rows) for k, _, _ in self.cols]

        def line(cells):
            out = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(cells)]
            return "  ".join(out).rstrip()

        lines = []
        if self.title:
            lines.append(self.title)
        lines.append(line(head))
        lines.append("  ".join("-" * w for w in widths))
        lines += [line(b) for b in body]
        return "\n".join(lines)

    def print(self, file=None) -> None:
        print(self.render(), file=file or sys.stdout, flush=True)

    def to_json(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    def __str__(self) -> str:
        return self.render()


def print_table(rows: Iterable[dict], columns: Sequence[Any] | None = None, title: str | None = None) -> str:
    """Print ``rows`` (dicts) as a plain-text table; columns default to the first row's keys."""
    rows = list(rows)
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    t = Table(columns, title=title)
    for r in rows:
        t.add(r)
    s = t.render()
    print(s, flush=True)
    return s


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if isinstance(o, (np.ndarray, jax.Array)):
        return np.asarray(o).tolist()
    if isinstance(o, np.dtype) or isinstance(o, type):
        return getattr(o, "__name__", str(o))
    if hasattr(o, "dtype") and hasattr(o, "name"):
        return str(o.name)
    return str(o)


def _clean(o):
    """NaN/inf -> None so the file is strict JSON; recurse through containers."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, (np.floating,)):
        return _clean(float(o))
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def close_quietly(ctx, shutdown: Callable[[], None]) -> None:
    """End of a benchmark script: close its jax_engram context (an error there must not hide the benchmark's own
    error or result), then ``shutdown`` (jax_engram.launch.shutdown)."""
    try:
        ctx.close()
    except Exception:  # noqa: BLE001
        pass
    shutdown()


def shown_args(args) -> dict:
    """The command-line arguments as a results file records them: ``--out`` and ``--profile`` by their last path
    component (no machine paths in committed results)."""
    d = dict(vars(args))
    for k in ("out", "profile"):
        if isinstance(d.get(k), str) and d[k]:
            d[k] = os.path.basename(os.path.normpath(d[k]))
    return d


def write_json(path: str, obj: Any) -> str:
    """Write ``obj`` as strict, indented JSON (numpy/jax values converted, NaN -> null)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    text = json.dumps(_clean(json.loads(json.dumps(obj, default=_json_default))), indent=1, allow_nan=False)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# large random tables
# --------------------------------------------------------------------------------------------
def _mix32(a):
    a = a ^ (a >> 16)
    a = a * jnp.uint32(0x7FEB352D)
    a = a ^ (a >> 15)
    a = a * jnp.uint32(0x846CA68B)
    return a ^ (a >> 16)


def hashed_rows_fn(rows: int, values: int, dtype, seed: int, sharding, *, ranks: int = 1,
                   shard_rows: int | None = None) -> Callable[..., jax.Array]:
    """A jitted maker ``make(start)`` of ``[rows, values]`` pseudo-random finite values of ``dtype`` (bfloat16,
    float16, float32 or float8_e4m3fn) with ``sharding``: one elementwise kernel of 32-bit words hashed from (table
    row, column), exponents masked so that no value is inf or NaN. Fills tens of GiB in about a second on a GPU,
    with no temporary of the table's size (jax.random would make one), so benchmark tables of production size are
    cheap to fill.

    Which table rows: the result is ``ranks`` equal pieces, rank-major; piece q holds rows ``q*shard_rows + start
    ..`` of a table with ``shard_rows`` rows per rank (default rows // ranks, so ``make(0)`` is the whole table).
    ``start`` is an operand: every slice of one table (fill_hashed) compiles once."""
    dt = np.dtype(dtype)
    if (values * dt.itemsize) % 4:
        raise ValueError(f"hashed_rows_fn: a row of {values} {dt.name} is not a whole number of 32-bit words")
    if rows % ranks:
        raise ValueError(f"hashed_rows_fn: {rows} rows are not {ranks} equal pieces")
    piece = rows // ranks
    shard_rows = piece if shard_rows is None else shard_rows

    def make(start):
        g = lax.broadcasted_iota(jnp.uint32, (rows, 1), 0)
        r = g // jnp.uint32(piece) * jnp.uint32(shard_rows) + jnp.asarray(start, jnp.uint32) + g % jnp.uint32(piece)
        return _hashed(r, values, dt, seed)
    return jax.jit(make, out_shardings=sharding)


def hashed_rows_at(ids: jax.Array, values: int, dtype, seed: int) -> jax.Array:
    """Rows ``ids`` (any shape of valid table rows) of the hashed_rows_fn table of ``seed``: ``[*ids.shape,
    values]``. A benchmark checks a lookup against it at any table size, without the table in memory."""
    r = jnp.asarray(ids).astype(jnp.uint32).reshape(-1, 1)
    return _hashed(r, values, np.dtype(dtype), seed).reshape(*jnp.shape(ids), values)


def _hashed(r, values: int, dt, seed: int):
    """[n, values] of dt from the table rows r [n, 1] (uint32): 32-bit words hashed from (row, column), the top
    exponent bit of every element cleared (fp8 e4m3fn exponent < 15, bf16 < 128, f16 < 16, f32 < 128): finite."""
    words = values * dt.itemsize // 4
    mask = {1: 0xBFBFBFBF, 2: 0xBFFFBFFF, 4: 0xBFFFFFFF}[dt.itemsize]
    narrow = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize]
    c = lax.broadcasted_iota(jnp.uint32, (r.shape[0], words), 1)
    w = _mix32(_mix32(r ^ jnp.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF)) + c) & jnp.uint32(mask)
    x = lax.bitcast_convert_type(w, narrow) if dt.itemsize < 4 else w
    return lax.bitcast_convert_type(x.reshape(r.shape[0], values), dt)


def fill_hashed(table, seed: int, *, sf_seed: int | None = None, sf_map: Callable | None = None,
                slice_bytes: int = 1 << 30) -> jax.Array:
    """Fills every rank's shard of ``table`` with hashed_rows_fn's rows of ``seed`` (table row g gets the generator's
    row g: the values of ``hashed_rows_fn(R*N, hidden, dtype, seed, ...)(0)``) and, with scale factors,
    ``sf_map`` of the float32 hashed rows of ``sf_seed``. A slice of at most ``slice_bytes`` of rows per rank at a
    time, made on the devices and written with ``write_global(row_offset=)``: the devices never hold a whole shard,
    so a host table larger than device memory fills. Returns the last write's ``done``."""
    mesh, ax = table.ctx.mesh, table.ctx.axis_name
    R, N = table.num_ranks, table.num_entries
    step = max(1, min(N, slice_bytes // table.row_bytes))
    rows_sh, rep = NamedSharding(mesh, P(ax, None)), NamedSharding(mesh, P())
    makers = {}
    for s0 in range(0, N, step):
        k = min(step, N - s0)
        if k not in makers:  # two sizes at most: the slices and the last one
            x = hashed_rows_fn(R * k, table.hidden, table.dtype, seed, rows_sh, ranks=R, shard_rows=N)
            sf = None
            if table.num_sf_packs:
                raw = hashed_rows_fn(R * k, table.num_sf_packs, np.float32, sf_seed, None, ranks=R, shard_rows=N)
                sf = jax.jit(lambda st, raw=raw: sf_map(raw(st)), out_shardings=rep)
            makers[k] = (x, sf)
        x, sf = makers[k]
        table.write_global(x(np.uint32(s0)), None if sf is None else sf(np.uint32(s0)), row_offset=s0)
    return table._token
