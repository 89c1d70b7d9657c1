"""The Engram host gather pool (CPU backend fetches; the CUDA host-table path with host_gather="cpu"): bit-exact
against ``jax_engram.reference`` for every mode, padding, FP8 + scale factors in both layouts and rows whose size
is not a multiple of 16 bytes, at 1 and several worker threads; two pending fetches whose waits each order after
their own fetch (distinct slots); the pool's threads and, on CUDA, the enqueue threads (started at the first fetch,
joined by ``ctx.close()``); a worker failure (the op raises naming the op and the rank); on CUDA an enqueue failure
(the wait raises once, naming the op and the rank); the config rule; the host measurement helpers.

Prints ``PASS name`` / ``FAIL name: why`` per case, a ``SUMMARY`` line and ``RESULT {...}``; exits 1 on a failure.

Run:  python tests/workers/engram_host_check.py --platform cpu --cpu-devices 3 [--threads 1]
      python tests/workers/engram_host_check.py --platform cuda               (host tables, host_gather="cpu")
      python -m jax_engram.launch -n 3 --platform cuda tests/workers/engram_host_check.py   (JAX_ENGRAM_GPUS=1:
      three ranks on one GPU)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from pathlib import Path

try:
    from jax_engram.launch import emit_result, initialize, shutdown
except ModuleNotFoundError as e:  # run straight from a source checkout
    if e.name not in ("jax_engram", "jax_engram.launch"):
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jax_engram.launch import emit_result, initialize, shutdown

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda"])
ap.add_argument("--cpu-devices", type=int, default=2)
ap.add_argument("--threads", type=int, default=3, help="EngramConfig.host_threads")
ap.add_argument("--only", default=None)
args = ap.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
cfg = initialize()

import jax  # noqa: E402

if cfg is None:
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    elif args.platform == "cuda":
        jax.config.update("jax_platforms", "cuda,cpu")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import _ffi, reference  # noqa: E402
from _harness import assert_same, make_ids, shard, threads_named  # noqa: E402

AX = "ep"
BF16, F32, FP8 = np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(ml_dtypes.float8_e4m3fn)
DEVS = jax.devices()
R = len(DEVS)
PLATFORM = DEVS[0].platform
NATIVE = _ffi.native("cpu" if PLATFORM == "cpu" else "gpu")
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,), devices=DEVS)
CONFIG = je.EngramConfig(host_gather="cpu", host_threads=args.threads)
_ref = jax.jit(reference.engram_lookup, static_argnames=("mode", "sf_layout"))


def new_ctx():
    return je.init(mesh, AX, timeout_s=120.0)


def make_data(seed, N, H, dt, packs, sf_dtype=np.float32):
    rng = np.random.default_rng(seed)
    if dt == FP8:  # random bytes without NaN encodings (0x7f / 0xff)
        x = (rng.integers(0, 256, size=(R * N, H), dtype=np.uint8) & 0xFE).view(dt)
    else:
        x = rng.standard_normal((R * N, H)).astype(dt)
    sf = rng.standard_normal((R * N, packs)).astype(np.float32).view(sf_dtype) if packs else None
    return x, sf


def sharded(a):
    return shard(a, mesh, P(AX, None))


def want(x, sf, ids, N, mode, layout):
    shards = x.reshape(R, N, x.shape[1])
    outs = [_ref(shards, b, mode=mode, sf_table=sf, sf_layout=layout) for b in np.split(ids, R)]
    return (np.concatenate([np.asarray(o[0]) for o in outs]),
            None if sf is None else np.concatenate([np.asarray(o[1]) for o in outs]))




def fetch_fn(t, mode, layout, overlap):
    def body(i):
        p = t.fetch(i, mode=mode, sf_layout=layout, overlap=overlap)
        d, s = t.wait(p)
        return d, (s if s is not None else jnp.zeros((1, 1), jnp.float32))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX, None), out_specs=(P(AX, None), P(AX, None))))


CASES = []


def filled_table(c, seed):
    """A 16 x 64 bf16 host table of context ``c`` written with seeded rows, seeded ids into it and its overlapped
    fill / row fetch: (table, rows, ids, fetch)."""
    t = je.EngramTable(16, 64, BF16, ctx=c, config=CONFIG)
    x, _ = make_data(seed, 16, 64, BF16, 0)
    t.write_global(x)
    return t, x, make_ids(seed + 1, R * 4, 3, t.total_entries), fetch_fn(t, "fill", "row", True)


def case(fn):
    CASES.append((fn.__name__, fn))
    return fn


def _matrix(ctx, dt, H, packs, sf_dtype, T, E, seed, placement="host"):
    N = 37
    t = je.EngramTable(N, H, dt, ctx=ctx, placement=placement, num_sf_packs=packs, sf_dtype=sf_dtype,
                       sf_placement=placement, config=CONFIG)
    x, sf = make_data(seed, N, H, dt, packs, sf_dtype)
    t.write_global(x, sf)
    for k, mode in enumerate(("fill", "clip", "checked")):
        ids = make_ids(seed + k, R * T, E, t.total_entries, special=(mode != "checked"))
        for layout in (("row", "tma_col_major") if packs else ("row",)):
            w, wsf = want(x, sf, ids, N, mode, layout)
            for overlap in ((False, True) if PLATFORM != "cpu" else (True,)):  # one path on CPU
                d, s = fetch_fn(t, mode, layout, overlap)(sharded(ids))
                assert_same(d, w, f"{dt.name} H={H} mode={mode} layout={layout} overlap={overlap}")
                if packs:
                    assert_same(s, wsf, f"sf {dt.name} mode={mode} layout={layout} overlap={overlap}")
    t.free()


@case
def modes_padding_bf16_f32(ctx):
    _matrix(ctx, BF16, 128, 0, np.float32, T=40, E=24, seed=1)    # 256-B rows, several work items per rank
    _matrix(ctx, F32, 64, 0, np.float32, T=7, E=5, seed=2)


@case
def odd_row_sizes(ctx):
    _matrix(ctx, BF16, 13, 0, np.float32, T=9, E=7, seed=3)       # 26-B rows: no 16-byte stores
    _matrix(ctx, F32, 5, 0, np.float32, T=4, E=3, seed=4)         # 20 B


@case
def fp8_scale_factors_both_layouts(ctx):
    _matrix(ctx, FP8, 256, 2, np.float32, T=6, E=24, seed=5)      # host sf table: gathered by the workers
    _matrix(ctx, FP8, 128, 1, np.int32, T=5, E=3, seed=6)


@case
def fp8_sf_in_device_memory(ctx):
    N, H = 16, 128
    t = je.EngramTable(N, H, FP8, ctx=ctx, placement="host", num_sf_packs=2, sf_placement="device", config=CONFIG)
    x, sf = make_data(7, N, H, FP8, 2)
    t.write_global(x, sf)
    ids = make_ids(8, R * 5, 6, t.total_entries)
    for layout in ("row", "tma_col_major"):
        w, wsf = want(x, sf, ids, N, "fill", layout)
        d, s = fetch_fn(t, "fill", layout, True)(sharded(ids))
        assert_same(d, w, f"data {layout}")
        assert_same(s, wsf, f"sf {layout}")
    t.free()


@case
def two_pending_fetches_own_slots(ctx):
    N, H = 64, 64
    a = je.EngramTable(N, H, BF16, ctx=ctx, config=CONFIG)
    b = je.EngramTable(N, H, BF16, ctx=ctx, config=CONFIG)
    xa, _ = make_data(9, N, H, BF16, 0)
    xb, _ = make_data(10, N, H, BF16, 0)
    a.write_global(xa)
    b.write_global(xb)
    ia = make_ids(11, R * 8, 4, a.total_entries)
    ib = make_ids(12, R * 16, 24, b.total_entries)

    def body(i, j):
        pa = a.fetch(i)
        pb = b.fetch(j)
        assert pa.slot != pb.slot and pa.slot > 0 and pb.slot > 0, (pa.slot, pb.slot)
        da, _ = a.wait(pa)
        y = jnp.tanh(da.astype(jnp.float32) @ jnp.ones((da.shape[1], 8), jnp.float32))
        db, _ = b.wait(pb, after=y)
        return da, db, y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P(AX, None)),
                              out_specs=(P(AX, None), P(AX, None), P(AX, None))))
    hlo = f.lower(sharded(ia), sharded(ib)).as_text()
    fetch_slots = re.findall(r"jax_engram_engram_fetch.*?slot = (\d+)", hlo)
    wait_slots = re.findall(r"jax_engram_engram_wait.*?slot = (\d+)", hlo)
    assert len(set(fetch_slots)) == 2 and sorted(fetch_slots) == sorted(wait_slots), (fetch_slots, wait_slots)
    da, db, _ = f(sharded(ia), sharded(ib))
    assert_same(da, want(xa, None, ia, N, "fill", "row")[0], "first pending fetch")
    assert_same(db, want(xb, None, ib, N, "fill", "row")[0], "second pending fetch")
    a.free()
    b.free()


@case
def thread_lifecycle(ctx):
    c = new_ctx()  # a fresh context: its pool starts at its first fetch and is joined by close
    before = threads_named("je-hostgather")
    enq_before = threads_named("je-enqueue")
    t = je.EngramTable(16, 64, BF16, ctx=c, config=CONFIG)
    x, _ = make_data(13, 16, 64, BF16, 0)
    t.write_global(x)
    local = [d.id if PLATFORM == "cpu" else d.local_hardware_id for d in DEVS if d.process_index == jax.process_index()]
    assert all(NATIVE.host_gather_threads(c.id, o) == 0 for o in local), "pool started before any fetch"
    ids = make_ids(14, R * 4, 3, t.total_entries)
    d, _ = t.lookup_global(sharded(ids), config=CONFIG)
    assert_same(d, want(x, None, ids, 16, "fill", "row")[0], "lookup")
    n = [NATIVE.host_gather_threads(c.id, o) for o in local]
    assert all(k == args.threads for k in n), n
    assert threads_named("je-hostgather") == before + args.threads * len(local), (threads_named("je-hostgather"), before)
    # CUDA: one enqueue thread per member, started by its first host-path fetch (it starts every job when the stream
    # gets there, and enqueues overlapped fetches), joined by close. The CPU backend has none.
    d, _ = fetch_fn(t, "fill", "row", True)(sharded(ids))
    assert_same(d, want(x, None, ids, 16, "fill", "row")[0], "overlapped fetch")
    enq = threads_named("je-enqueue") - enq_before
    assert enq == (0 if PLATFORM == "cpu" else len(local)), f"{enq} enqueue threads for {len(local)} members"
    c.close()
    assert threads_named("je-hostgather") == before, f"{threads_named("je-hostgather") - before} host gather threads left after close"
    assert threads_named("je-enqueue") == enq_before, "enqueue threads left after close"


@case
def worker_failure(ctx):
    # CPU: the fetch fails, the context stays usable. CUDA: the failure is recorded in the context (the stream
    # still completes: every flag is set), so ctx.check() / the next op raises; a context of its own here.
    c = new_ctx()
    try:
        t, x, ids, f = filled_table(c, 15)
        N = t.num_entries
        NATIVE._test_fail_next_host_gather(c.id)
        try:
            jax.block_until_ready(f(sharded(ids)))
            c.check()
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            assert "engram fetch" in msg and "rank" in msg and "host gather" in msg, msg[:2000]
        else:
            raise AssertionError("a failing host gather worker did not fail the op")
        if PLATFORM == "cpu":
            c.check()  # the public way on: the call raised already, check() forgets it (nothing recorded on CPU)
            d, _ = f(sharded(ids))
            assert_same(d, want(x, None, ids, N, "fill", "row")[0], "fetch after a failure")
            c.check()
    finally:
        c.close()


@case
def enqueue_failure(ctx):
    # CUDA: the next overlapped host-path fetch fails on the member's enqueue thread (nothing is enqueued); its wait
    # raises naming the op and the rank, once, and the same call then works. The CPU backend has no enqueue thread:
    # the hook changes nothing there.
    t, x, ids, f = filled_table(ctx, 17)
    w = want(x, None, ids, t.num_entries, "fill", "row")[0]
    assert_same(f(sharded(ids))[0], w, "before the failure")
    NATIVE._test_fail_next_host_enqueue(ctx.id)
    try:
        d, _ = f(sharded(ids))
        jax.block_until_ready(d)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        assert PLATFORM != "cpu", msg[:2000]
        assert "engram fetch" in msg and "rank" in msg and "injected failure" in msg, msg[:2000]
    else:
        assert PLATFORM == "cpu", "a failed enqueue did not fail the wait"
        assert_same(d, w, "CPU: the hook has no effect")
    for _ in range(2):  # usable at once, and the failure is not reported again
        assert_same(f(sharded(ids))[0], w, "after the failure")
        ctx.check()
    t.free()


@case
def config_rule(ctx):
    lim = _ffi.native("cpu").engram_layout["host_gather_gpu_max_shard_bytes"]
    c = je.EngramConfig()
    assert c.host_path("host", 1 << 20, True) == "cpu" and c.host_path("host", 1 << 20, False) == "gpu"
    assert c.host_path("host", lim + 1, False) == "cpu" and c.host_path("device", lim + 1, True) == "gpu"
    assert je.EngramConfig(host_gather="gpu").host_path("host", 1 << 40, True) == "gpu"
    t = je.EngramTable(8, 16, BF16, ctx=ctx)
    assert t.host_path(True) == "cpu" and t.host_path(False) == "gpu"
    t.free()
    for bad in (dict(host_gather="sm"), dict(host_threads=-1), dict(host_threads=10**6)):
        try:
            je.EngramConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"EngramConfig({bad}) was accepted")


@case
def measurement_helpers(ctx):
    m = _ffi.native("cpu")
    bw = m.host_memory_bandwidth(8 << 20, 2)
    assert all(bw[k] > 0 for k in ("read_gbps", "memcpy_gbps", "nt_write_gbps")), bw
    g = m.host_gather_rate(32 << 20, 256, 4096, 2, 2)
    assert g["gather_gbps"] > 0, g


def main():
    ctx = new_ctx()
    info = dict(platform=PLATFORM, ranks=R, processes=jax.process_count(), threads=args.threads)
    print(f"engram_host_check: {info}", flush=True)
    passed, failed = [], {}
    for name, fn in CASES:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            fn(ctx)
            ctx.check()
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"FAIL {name}: {failed[name]}", flush=True)
            traceback.print_exc()
        else:
            passed.append(name)
            print(f"PASS {name} ({time.perf_counter() - t0:.2f}s)", flush=True)
    ctx.close()
    print(f"SUMMARY engram_host_check: {len(passed)} passed, {len(failed)} failed ({PLATFORM}, {R} ranks, "
          f"{args.threads} threads)", flush=True)
    emit_result(dict(info, passed=passed, failed=failed))
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    shutdown()
    sys.exit(rc)
