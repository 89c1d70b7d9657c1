"""Host-side ceilings of the Engram host paths, measured with the CPU module's probes where this build has them:

* ``memory_bandwidth(nbytes, threads)``: ``_engram_cpu.host_memory_bandwidth`` -> read / memcpy / non-temporal
  write GB/s of host memory (what bounds a CPU gather into pinned staging followed by a copy to the GPU);
* ``gather_rate(table_bytes, row_bytes, num_rows, threads, repeats)``: ``_engram_cpu.host_gather_rate`` -> GB/s of
  random rows gathered by CPU threads from a host table of ``table_bytes`` (no GPU involved; every repeat gathers
  other rows, so none is served from the host's caches);
* ``llc_bytes()``: the host's last-level cache (sysfs), which fresh-row benchmarks must exceed;
* ``gather_in_processes(nprocs, ...)``: that gather in ``nprocs`` processes at once (one per GPU of a node share
  its host memory) over one common timed window, per-process and total GB/s.

Every function returns a dict; where the probe is missing it returns ``{"skipped": reason}`` instead of failing,
so the benchmarks run (and say so) on builds without it. No JAX device work here.

Run as a script, this file is the worker of ``gather_in_processes`` (it reads "go <start> <window>" on stdin, then
gathers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

_PROBES = ("host_memory_bandwidth", "host_gather_rate")


def _native(name: str):
    try:
        from jax_engram import _ffi

        return getattr(_ffi.native("cpu"), name, None)
    except Exception:  # noqa: BLE001 - a missing module is reported as a skip, like a missing probe
        return None


def _skip(name: str) -> dict:
    return dict(skipped=f"jax_engram's CPU module has no {name}() in this build: ceiling not measured")


def _call(name: str, *a) -> dict:
    fn = _native(name)
    if fn is None:
        return _skip(name)
    try:
        out = dict(fn(*a))
    except Exception as e:  # noqa: BLE001 - one failed probe must not lose the benchmark
        return dict(error=f"{name}: {type(e).__name__}: {str(e)[:300]}")
    return {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in out.items()}


def memory_bandwidth(nbytes: int, threads: int) -> dict:
    """Host memory bandwidth with ``threads`` threads over ``nbytes``: read_gbps, memcpy_gbps, nt_write_gbps."""
    return dict(_call("host_memory_bandwidth", int(nbytes), int(threads)), bytes=int(nbytes), threads=int(threads))


def gather_rate(table_bytes: int, row_bytes: int, num_rows: int, threads: int, repeats: int,
                start_at_s: float = 0.0, min_seconds: float = 0.0) -> dict:
    """GB/s of ``num_rows`` random ``row_bytes`` rows gathered by ``threads`` CPU threads from a ``table_bytes`` host
    table (the probe allocates and fills its own table): gather_gbps (best of ``repeats``); with ``start_at_s`` /
    ``min_seconds`` also mean_gbps over a timed window that starts at that wall-clock time and lasts that long."""
    return dict(_call("host_gather_rate", int(table_bytes), int(row_bytes), int(num_rows), int(threads),
                      int(repeats), float(start_at_s), float(min_seconds)), table_bytes=int(table_bytes),
                row_bytes=int(row_bytes), num_rows=int(num_rows), threads=int(threads), repeats=int(repeats))


def llc_bytes(root: str = "/sys/devices/system/cpu") -> int | None:
    """Bytes of this host's last-level CPU caches (every distinct instance of the highest cache level in sysfs,
    summed), or None where sysfs does not say. A benchmark that gathers random host rows cycles through enough id
    sets to exceed this, so that a repeat does not find its rows in the cache its previous run filled."""
    import glob

    seen: dict[tuple[int, str], int] = {}
    for d in glob.glob(os.path.join(root, "cpu[0-9]*", "cache", "index[0-9]*")):
        try:
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(d, "shared_cpu_list")) as f:
                shared = f.read().strip()
            with open(os.path.join(d, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        try:
            seen[(level, shared)] = int(size.rstrip("KMGkmg")) * unit
        except ValueError:
            continue
    if not seen:
        return None
    top = max(level for level, _ in seen)
    return sum(b for (level, _), b in seen.items() if level == top)


def default_threads(nprocs: int = 1) -> int:
    """Gather threads per process when ``nprocs`` processes share this host: the library's default for one process
    (three quarters of the cores, at most 12: the rest stay with XLA's own threads), split evenly over the processes."""
    return max(1, min(12, (os.cpu_count() or 1) * 3 // 4) // max(1, nprocs))


def gather_in_processes(nprocs: int, table_bytes: int, row_bytes: int, num_rows: int, threads: int, repeats: int,
                        timeout_s: float = 300.0, window_s: float = 1.0) -> dict:
    """``gather_rate`` in ``nprocs`` processes at once: every worker allocates and fills its own table, then all
    gather over one common wall-clock window (it starts once every table is filled, by a generous estimate, and
    lasts ``window_s``). Returns per-process results, total_gbps (sum of the window rates), min/max per process,
    and overlap: the fraction of the span of all windows during which every process was gathering (1.0 = all at
    once; the figures mean "at once" only near 1)."""
    out = dict(processes=nprocs, threads_per_process=threads, table_bytes=table_bytes, num_rows=num_rows)
    if _native("host_gather_rate") is None:
        return dict(out, **_skip("host_gather_rate"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), str(table_bytes), str(row_bytes), str(num_rows), str(threads),
           str(repeats)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(nprocs)]
    try:
        deadline = time.time() + timeout_s
        for p in procs:  # each prints "ready" once imported
            line = p.stdout.readline()
            if line.strip() != "ready" or time.time() > deadline:
                raise RuntimeError(f"a gather worker did not start: {line.strip()!r} {p.stderr.read()[-300:]}")
        # Every process fills its own table first (memset, all at once): start the common window after a
        # generous estimate of that (2 GB/s per process), and check below that every window began on time.
        start_at = time.time() + 1.0 + nprocs * table_bytes / 2e9
        for p in procs:
            p.stdin.write(f"go {start_at!r} {window_s!r}\n")
            p.stdin.flush()
        res = []
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.time()))
            if p.returncode != 0:
                raise RuntimeError(f"a gather worker failed (exit {p.returncode}): {e[-300:]}")
            res.append(json.loads(o.strip().splitlines()[-1]))
    except Exception as e:  # noqa: BLE001
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        return dict(out, error=f"{type(e).__name__}: {str(e)[:400]}")
    rates = [r.get("mean_gbps") for r in res]
    out.update(per_process=res)
    if all(isinstance(r, float) for r in rates):
        starts = [r["window_start_s"] for r in res]
        ends = [r["window_end_s"] for r in res]
        span = max(ends) - min(starts)
        out.update(total_gbps=sum(rates), min_gbps=min(rates), max_gbps=max(rates),
                   overlap=max(0.0, min(ends) - max(starts)) / span if span > 0 else 0.0)
    return out


def _worker(argv: list[str]) -> int:
    table_bytes, row_bytes, num_rows, threads, repeats = (int(a) for a in argv)
    _native("host_gather_rate")  # import before "ready": the start of the gathers is not spread by imports
    print("ready", flush=True)
    go = sys.stdin.readline().split()
    if not go or go[0] != "go":
        return 2
    start_at, window_s = (float(v) for v in go[1:3]) if len(go) >= 3 else (0.0, 0.0)
    t0 = time.perf_counter()
    r = gather_rate(table_bytes, row_bytes, num_rows, threads, repeats, start_at, window_s)
    r["wall_s"] = time.perf_counter() - t0
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
