"""Engram correctness matrix on whatever platform this runs on (CPU devices or GPUs; 1..N processes).

Every lookup is compared bit-exactly with ``jax_engram.reference.engram_lookup`` on the whole table
(built identically from a seed in every process). Prints one ``PASS name (s)`` / ``FAIL name: why`` line
per case and ends with ``emit_result({"passed": [...], "failed": {...}, ...})``; exits 1 if a case failed.

Run:
  under the launcher:  python -m jax_engram.launch -n 2 [--platform cuda] tests/workers/engram_check.py
  one process:         python tests/workers/engram_check.py --platform cpu --cpu-devices 4
                       python tests/workers/engram_check.py --platform cuda        (all local GPUs)
Options: --suite full|core|quick (what to run), --only SUBSTR (case names containing it), --list,
--gather default|tma|sm (the EngramConfig of every table: "tma" makes lookups use the bulk-copy gather too,
"sm" makes overlapped fetches use the full-grid gather too; --num-sms sets its SMs).

Cases (suite membership in brackets): dtype x placement with every mode and both sf layouts [full: all,
core: all dtypes host + bf16 device, quick: bf16 + fp8/col host]; E in {1, 24, 32} x hidden {64, 128};
hidden 7168 with small T (bf16, fp8 + 56 packs); rows not a multiple of 16 bytes; replicated ids;
non-int32 ids (saturating); write -> fetch in one jit; second write replaces the table (also within one
jit, ordered by the lookup's data); fetch / XLA work / wait; both gathers and their configs against each
other (many chunks per pipeline, rows larger than a chunk, small num_sms, every mode, FP8 + sf, fetch and
lookup); EngramConfig validation; jit cache when T changes; fetch before any
write; T = 0; init reservations (carving and the "too small" error); trace-time validation; checked mode
out of range (raised once by the call; the table and its context stay usable).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import traceback
import zlib
from pathlib import Path

try:
    from jax_engram.launch import emit_result, initialize, shutdown
except ModuleNotFoundError as e:  # run straight from a source checkout
    if e.name not in ("jax_engram", "jax_engram.launch"):
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jax_engram.launch import emit_result, initialize, shutdown

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda"],
                help="standalone runs: jax platform (ignored under the launcher, which sets it)")
ap.add_argument("--cpu-devices", type=int, default=4, help="standalone CPU runs: number of CPU devices")
ap.add_argument("--suite", default="full", choices=["full", "core", "quick"])
ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
ap.add_argument("--list", action="store_true")
ap.add_argument("--gather", default="default", choices=["default", "tma", "sm", "sm_few"],
                help="EngramConfig of every table: default, or this gather for fetch and lookup alike")
ap.add_argument("--num-sms", type=int, default=None, help="EngramConfig.num_sms of every table")
ap.add_argument("--host-gather", default="auto", choices=["auto", "cpu", "gpu"],
                help="EngramConfig.host_gather of every table (who moves host-placed rows on a GPU)")
ap.add_argument("--host-threads", type=int, default=0, help="EngramConfig.host_threads of every table")
args = ap.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
cfg = initialize()  # before anything touches a JAX backend

import jax  # noqa: E402

if cfg is None:
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    elif args.platform == "cuda":
        jax.config.update("jax_platforms", "cuda,cpu")  # cpu: host callbacks (checked mode)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import reference  # noqa: E402

AX = "ep"
BF16, F16, F32, FP8 = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32),
                       np.dtype(ml_dtypes.float8_e4m3fn))
DEVS = jax.devices()
R = len(DEVS)
PLATFORM = DEVS[0].platform
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,), devices=DEVS)
ctx = je.init(mesh, AX, timeout_s=120.0)
_cfg_kw = {} if args.gather == "default" else dict(fetch_gather=args.gather, lookup_gather=args.gather)
if args.num_sms is not None:
    _cfg_kw["num_sms"] = args.num_sms
_cfg_kw.update(host_gather=args.host_gather, host_threads=args.host_threads)
CONFIG = je.EngramConfig(**_cfg_kw)
_ref = jax.jit(reference.engram_lookup, static_argnames=("mode", "sf_layout"))


# ------------------------------------------------------------------------------------------- data
def _uint(dt):
    return np.dtype(f"u{np.dtype(dt).itemsize}")


def random_bits(rng, shape, dt):
    """Random bit patterns of dtype dt without NaNs (reference.engram_lookup canonicalises NaN payloads on
    XLA:CPU), so any value conversion in the op shows up as a bit mismatch."""
    dt = np.dtype(dt)
    u = rng.integers(0, 2 ** (8 * dt.itemsize), size=shape, dtype=np.uint64).astype(_uint(dt))
    if dt == FP8:
        u = np.where((u & 0x7F) == 0x7F, u ^ 0x01, u)
    else:
        exp = {2: 0x7C00 if dt == F16 else 0x7F80, 4: 0x7F800000}[dt.itemsize]
        hi = {2: 0x4000, 4: 0x40000000}[dt.itemsize]
        u = np.where((u & exp) == exp, u & ~np.array(hi, u.dtype), u)
    return u.astype(_uint(dt)).view(dt)


def make_table_data(seed, N, H, dt, packs, sf_dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = random_bits(rng, (R * N, H), dt)
    sf = random_bits(rng, (R * N, packs), np.float32).view(sf_dtype) if packs else None
    return x, sf


def make_ids(seed, rows, E, total, special=True):
    """[rows, E] global ids: uniform valid ids plus (special=True) padding (-1, -7), out-of-range ids
    (total, total+5, 2**31-1) and the edges (0, total-1)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, total, size=(rows, E), dtype=np.int64)
    if special:
        pool = np.array([-1, -7, total, total + 5, 2**31 - 1, 0, total - 1], np.int64)
        mask = rng.random((rows, E)) < 0.3
        ids = np.where(mask, pool[rng.integers(0, len(pool), size=(rows, E))], ids)
    return ids.astype(np.int32)


def bits(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(_uint(a.dtype)) if a.dtype.itemsize in (1, 2, 4, 8) else a


def reference_lookup(x, sf, ids, N, mode, sf_layout, sharded=True):
    """Reference for the global result of lookup_global: per-rank blocks stacked along axis 0 (sharded) or
    the lookup of all ids (replicated)."""
    H = x.shape[1]
    shards = x.reshape(R, N, H)
    blocks = np.split(ids, R) if sharded else [ids]
    outs = [_ref(shards, b, mode=mode, sf_table=sf, sf_layout=sf_layout) for b in blocks]
    data = np.concatenate([np.asarray(o[0]) for o in outs])
    s = None if sf is None else np.concatenate([np.asarray(o[1]) for o in outs])
    return data, s


def assert_global_equal(got, want, what):
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is None and 'None'} want {want is None and 'None'}"
        return
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != reference {want.shape}"
    for s in got.addressable_shards:
        g, w = bits(s.data), bits(want[s.index])
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            raise AssertionError(f"{what}: {len(bad)} of {g.size} elements differ on {s.device} (first at "
                                 f"{bad[0].tolist()} of shard {s.index}: got {g[tuple(bad[0])]:#x}, want "
                                 f"{w[tuple(bad[0])]:#x})")


def sharded(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(AX, None)), lambda i: a[i])


def replicated(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P()), lambda i: a[i])


def check_lookups(table, x, sf, seed, T, E, modes=("fill", "clip", "checked"), layouts=("row",)):
    for k, mode in enumerate(modes):
        ids = make_ids(seed + k, R * T, E, table.total_entries, special=(mode != "checked"))
        for layout in layouts:
            data, s = table.lookup_global(sharded(ids), mode=mode, sf_layout=layout)
            want, want_sf = reference_lookup(x, sf, ids, table.num_entries, mode, layout)
            assert_global_equal(data, want, f"data mode={mode} sf_layout={layout}")
            assert_global_equal(s, want_sf, f"sf mode={mode} sf_layout={layout}")


def new_table(N, H, dt, placement, packs=0, sf_dtype=np.float32, c=None, config=None):
    return je.EngramTable(N, H, dt, ctx=c or ctx, placement=placement, num_sf_packs=packs, sf_dtype=sf_dtype,
                          config=config or CONFIG)


# ------------------------------------------------------------------------------------------ cases
CASES = []


def case(name, suites=("full",)):
    def deco(fn):
        CASES.append((name, set(suites), fn))
        return fn
    return deco


def _dtype_case(dt, placement, suites):
    tag = {BF16: "bf16", F16: "f16", F32: "f32", FP8: "fp8"}[dt]

    @case(f"dtype_{tag}_{placement}", suites)
    def _():
        packs = 2 if dt == FP8 else 0
        N, H = 64, 128
        t = new_table(N, H, dt, placement, packs, sf_dtype=np.int32 if placement == "device" else np.float32)
        x, sf = make_table_data(zlib.crc32(f'{tag}{placement}'.encode()) % 1000, N, H, dt, packs, t.sf_dtype)
        t.write_global(x, sf)
        check_lookups(t, x, sf, 10, T=6, E=24, layouts=("row", "tma_col_major") if packs else ("row",))


for _dt in (BF16, F16, F32, FP8):
    for _pl in ("host", "device"):
        _s = ["full"]
        if _pl == "host" or _dt == BF16:
            _s.append("core")
        if (_dt, _pl) in ((BF16, "host"), (FP8, "host")):
            _s.append("quick")
        _dtype_case(_dt, _pl, _s)


@case("E_sweep_hidden_64_128", ("full", "core"))
def _():
    for H in (64, 128):
        N = 50
        t = new_table(N, H, BF16, "device")
        x, _ = make_table_data(H, N, H, BF16, 0)
        t.write_global(x)
        for E in (1, 24, 32):
            check_lookups(t, x, None, 100 + E, T=5, E=E, modes=("fill",))


@case("hidden_7168_small_T", ("full", "core", "quick"))
def _():
    N, H = 8, 7168
    t = new_table(N, H, BF16, "host")
    x, _ = make_table_data(7168, N, H, BF16, 0)
    t.write_global(x)
    check_lookups(t, x, None, 7, T=2, E=24, modes=("fill", "clip"))
    t8 = new_table(N, H, FP8, "device", packs=56)
    x8, sf8 = make_table_data(7169, N, H, FP8, 56)
    t8.write_global(x8, sf8)
    check_lookups(t8, x8, sf8, 8, T=3, E=32, modes=("fill",), layouts=("row", "tma_col_major"))


@case("rows_not_multiple_of_16_bytes", ("full", "core"))
def _():
    for H, dt, packs in ((100, BF16, 0), (66, F16, 0), (65, FP8, 1), (1, F32, 0), (3, BF16, 0)):
        N = 33
        t = new_table(N, H, dt, "device", packs)
        x, sf = make_table_data(H * 7, N, H, dt, packs)
        t.write_global(x, sf)
        check_lookups(t, x, sf, H, T=3, E=5, modes=("fill", "clip"),
                      layouts=("tma_col_major",) if packs else ("row",))


@case("replicated_ids", ("full", "core", "quick"))
def _():
    N, H, packs = 40, 64, 1
    t = new_table(N, H, FP8, "host", packs)
    x, sf = make_table_data(5, N, H, FP8, packs)
    t.write_global(x, sf)
    for T, layout in ((7, "row"), (5, "tma_col_major")):
        ids = make_ids(T, T, 3, t.total_entries)
        data, s = t.lookup_global(ids, mode="clip", sf_layout=layout)  # numpy ids -> replicated
        want, want_sf = reference_lookup(x, sf, ids, N, "clip", layout, sharded=False)
        assert data.sharding.is_fully_replicated
        assert_global_equal(data, want, "replicated data")
        assert_global_equal(s, want_sf, "replicated sf")


@case("non_int32_ids_saturate", ("full",))
def _():
    N, H = 16, 64
    t = new_table(N, H, F32, "device")
    x, _ = make_table_data(3, N, H, F32, 0)
    t.write_global(x)
    ids_u = np.array([[0, 5, 2**32 - 16, 2**31], [R * N - 1, 3, 2**31 - 1, 1]], np.uint32)
    ids_i16 = np.array([[-3, 5, 7, R * N - 1]], np.int16)
    for ids, want_ids in ((ids_u, np.minimum(ids_u.astype(np.int64), 2**31 - 1).astype(np.int32)),
                          (ids_i16, ids_i16.astype(np.int32))):
        for mode in ("fill", "clip"):
            f = jax.jit(jax.shard_map(lambda i, m=mode: t.lookup(i, mode=m)[0], mesh=mesh, in_specs=P(),
                                      out_specs=P()))
            data = f(replicated(ids))
            want, _ = reference_lookup(x, None, want_ids, N, mode, "row", sharded=False)
            assert_global_equal(data, want, f"{ids.dtype} ids mode={mode}")


@case("write_fetch_one_jit", ("full", "core", "quick"))
def _():
    N, H, packs = 32, 128, 1
    t = new_table(N, H, FP8, "host", packs)

    def body(xl, sf, ids):
        tok = t.write(xl, sf)
        data, s = t.lookup(ids, tok, sf_layout="tma_col_major")
        return data, s

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P(), P(AX, None)),
                              out_specs=(P(AX, None), P(AX, None))))
    for seed in (1, 2):  # the second call writes a different table through the same executable
        x, sf = make_table_data(50 + seed, N, H, FP8, packs)
        ids = make_ids(seed, R * 4, 24, t.total_entries)
        data, s = f(sharded(x), replicated(sf), sharded(ids))
        want, want_sf = reference_lookup(x, sf, ids, N, "fill", "tma_col_major")
        assert_global_equal(data, want, f"data (call {seed})")
        assert_global_equal(s, want_sf, f"sf (call {seed})")
    assert f._cache_size() == 1, f"write->fetch recompiled: cache size {f._cache_size()}"


@case("second_write_replaces", ("full", "core", "quick"))
def _():
    N, H = 24, 64
    t = new_table(N, H, BF16, "device")
    xa, _ = make_table_data(61, N, H, BF16, 0)
    xb, _ = make_table_data(62, N, H, BF16, 0)
    ids = make_ids(63, R * 5, 24, t.total_entries)
    # separate calls (global API, chained by the table's token)
    for x in (xa, xb, xa):
        t.write_global(x)
        data, _ = t.lookup_global(sharded(ids))
        assert_global_equal(data, reference_lookup(x, None, ids, N, "fill", "row")[0], "global write/lookup")

    # one program: write A, look up, write B after the lookup (token = its data), look up again
    def body(a, b, i):
        da, _ = t.wait(t.fetch(i, t.write(a)))  # overlapped fetch (GPU side stream), then a write after it
        db, _ = t.lookup(i, t.write(b, token=da))
        return da, db

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None),) * 3, out_specs=(P(AX, None),) * 2))
    da, db = f(sharded(xa), sharded(xb), sharded(ids))
    assert_global_equal(da, reference_lookup(xa, None, ids, N, "fill", "row")[0], "first lookup in one jit")
    assert_global_equal(db, reference_lookup(xb, None, ids, N, "fill", "row")[0], "second lookup in one jit")


@case("fetch_overlap_wait", ("full", "core"))
def _():
    N, H = 48, 256
    t = new_table(N, H, F16, "host")
    x, _ = make_table_data(71, N, H, F16, 0)
    t.write_global(x)
    ids = make_ids(72, R * 16, 8, t.total_entries)

    def body(i, y):
        pend = t.fetch(i, mode="clip")
        for _ in range(3):  # independent XLA work between fetch and wait
            y = jnp.tanh(y @ y.T) @ y
        data, _ = t.wait(pend, token=y)  # the wait comes after the work
        return data, y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P(AX, None)),
                              out_specs=(P(AX, None), P(AX, None))))
    y0 = np.ones((R * 8, 8), np.float32)
    data, _ = f(sharded(ids), sharded(y0))
    assert_global_equal(data, reference_lookup(x, None, ids, N, "clip", "row")[0], "fetch/work/wait")



# Gathers against each other and the reference: every config below must give the reference's bits. On GPU they
# are different kernels ("tma": bulk copies on few CTAs; "sm": vector loads); on CPU one gather serves all.
_GATHER_CONFIGS = {
    "tma_1sm_min_smem": je.EngramConfig(fetch_gather="tma", lookup_gather="tma", num_sms=1, tma_smem_kib=16),
    "tma_3sm": je.EngramConfig(fetch_gather="tma", lookup_gather="tma", num_sms=3, tma_smem_kib=64),
    "tma_default": je.EngramConfig(lookup_gather="tma"),
    "sm_full_grid": je.EngramConfig(fetch_gather="sm", lookup_gather="sm", sm_loads="volatile"),
    "sm_few_2sm": je.EngramConfig(fetch_gather="sm_few", lookup_gather="sm_few", num_sms=2, sm_loads="plain"),
}


def _check_configs(t, x, sf, T, E, modes, layouts, seed, configs=tuple(_GATHER_CONFIGS)):
    """Every config: lookups in every mode / layout, and one overlapped fetch (first mode, last layout)."""
    for name in configs:
        cfg = _GATHER_CONFIGS[name]
        for k, mode in enumerate(modes):
            ids = make_ids(seed + k, R * T, E, t.total_entries, special=(mode != "checked"))
            for layout in layouts:
                want, want_sf = reference_lookup(x, sf, ids, t.num_entries, mode, layout)
                data, s = t.lookup_global(sharded(ids), mode=mode, sf_layout=layout, config=cfg)
                assert_global_equal(data, want, f"lookup {name} mode={mode} sf_layout={layout}")
                assert_global_equal(s, want_sf, f"lookup sf {name} mode={mode} sf_layout={layout}")
                if k or layout != layouts[-1]:
                    continue

                def body(i, m=mode, lay=layout, c=cfg):  # overlapped fetch (side stream on GPU) with XLA work
                    pend = t.fetch(i, mode=m, sf_layout=lay, config=c)
                    y = jnp.tanh(jnp.ones((64, 64), jnp.float32) @ jnp.ones((64, 64), jnp.float32))
                    d, s2 = t.wait(pend, token=y)
                    return d, (s2 if s2 is not None else jnp.zeros((1, 1), jnp.float32))

                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX, None),
                                          out_specs=(P(AX, None), P(AX, None))))
                d, s2 = f(sharded(ids))
                assert_global_equal(d, want, f"fetch {name} mode={mode} sf_layout={layout}")
                if sf is not None:
                    assert_global_equal(s2, want_sf, f"fetch sf {name} mode={mode} sf_layout={layout}")


@case("gather_configs_bf16_host_many_chunks", ("full", "core", "quick"))
def _():
    # 300 tokens x 24 ids x 256 B = 1.8 MB per rank: many chunks per pipeline at 1 SM / 16 KiB (1 KiB chunks)
    N, H = 512, 128
    t = new_table(N, H, BF16, "host")
    x, _ = make_table_data(201, N, H, BF16, 0)
    t.write_global(x)
    _check_configs(t, x, None, T=300, E=24, modes=("fill", "clip"), layouts=("row",), seed=202)


@case("gather_configs_every_dtype", ("full", "core"))
def _():
    for dt, pl, H, packs in ((F16, "device", 64, 0), (F32, "host", 32, 0), (FP8, "device", 256, 2),
                             (FP8, "host", 128, 1)):
        N = 40
        t = new_table(N, H, dt, pl, packs)
        x, sf = make_table_data(int(H) + packs, N, H, dt, packs, t.sf_dtype)
        t.write_global(x, sf)
        _check_configs(t, x, sf, T=7, E=24, modes=("fill", "checked"),
                       layouts=("row", "tma_col_major") if packs else ("row",), seed=H,
                       configs=("tma_1sm_min_smem", "tma_3sm"))


@case("gather_configs_rows_larger_than_chunk", ("full", "core", "quick"))
def _():
    # 14 KiB rows over 1 KiB chunks (tma_1sm_min_smem): every row is many pieces in many chunks; padding rows too
    N, H = 8, 7168
    t = new_table(N, H, BF16, "host")
    x, _ = make_table_data(301, N, H, BF16, 0)
    t.write_global(x)
    _check_configs(t, x, None, T=3, E=5, modes=("fill",), layouts=("row",), seed=302,
                   configs=("tma_1sm_min_smem", "tma_default"))


@case("gather_configs_rows_not_multiple_of_16", ("full", "core"))
def _():
    # bulk copies need 16-byte rows: "tma" falls back to the vector gather on num_sms CTAs
    for H, dt in ((100, BF16), (3, BF16), (65, FP8)):
        packs = 1 if dt == FP8 else 0
        N = 33
        t = new_table(N, H, dt, "device", packs)
        x, sf = make_table_data(H * 11, N, H, dt, packs)
        t.write_global(x, sf)
        _check_configs(t, x, sf, T=9, E=5, modes=("fill", "clip"), layouts=("row",), seed=H,
                       configs=("tma_1sm_min_smem", "sm_few_2sm"))


@case("config_validation", ("full", "core", "quick"))
def _():
    _raises(lambda: je.EngramConfig(fetch_gather="dma"), ValueError, "fetch_gather")
    _raises(lambda: je.EngramConfig(lookup_gather="x"), ValueError, "lookup_gather")
    _raises(lambda: je.EngramConfig(num_sms=0), ValueError, "num_sms")
    _raises(lambda: je.EngramConfig(num_sms=True), ValueError, "num_sms")
    _raises(lambda: je.EngramConfig(tma_smem_kib=8), ValueError, "tma_smem_kib")
    _raises(lambda: je.EngramConfig(sm_loads="ca"), ValueError, "sm_loads")
    _raises(lambda: je.EngramConfig(sm_blocks_per_sm=-1), ValueError, "sm_blocks_per_sm")
    _raises(lambda: new_table(8, 64, BF16, "device", config="tma"), TypeError, "EngramConfig")
    c = je.EngramConfig(num_sms=2)
    assert c == je.EngramConfig(num_sms=2) and hash(c) == hash(je.EngramConfig(num_sms=2))
    assert c.gather(True) == "tma" and c.gather(False) == "sm"
    a = c.ffi_attrs(True)
    assert a == dict(gather=1, gather_sms=2, tma_smem_bytes=192 * 1024, sm_loads=0, sm_blocks_per_sm=0), a
    try:
        c.num_sms = 3
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("EngramConfig is not frozen")
    # a config is part of the jit cache key: a lookup with another config compiles its own executable
    t = new_table(16, 64, BF16, "device")
    x, _ = make_table_data(401, 16, 64, BF16, 0)
    t.write_global(x)
    ids = make_ids(402, R * 2, 3, t.total_entries)
    for cfg in (None, je.EngramConfig(lookup_gather="tma", num_sms=1)):
        data, _ = t.lookup_global(sharded(ids), config=cfg)
        assert_global_equal(data, reference_lookup(x, None, ids, 16, "fill", "row")[0], f"config {cfg}")
    assert t._lookup_fn("fill", "row", True)._cache_size() == 1
    assert t._lookup_fn("fill", "row", True, je.EngramConfig(lookup_gather="tma", num_sms=1))._cache_size() == 1


_FETCH_ATTRS = re.compile(r"@jax_engram_engram_fetch\([^)]*\)\s*\{[^\n]*?mhlo\.backend_config = (\{[^}]*\})")


@case("jit_cache_when_T_changes", ("full", "core", "quick"))
def _():
    N, H = 16, 64
    t = new_table(N, H, BF16, "device")
    x, _ = make_table_data(81, N, H, BF16, 0)
    t.write_global(x)
    for T in (4, 8, 4, 8, 4):
        ids = make_ids(T, R * T, 24, t.total_entries)
        data, _ = t.lookup_global(sharded(ids))
        assert_global_equal(data, reference_lookup(x, None, ids, N, "fill", "row")[0], f"T={T}")
    fn = t._lookup_fn("fill", "row", True)
    assert fn._cache_size() == 2, f"expected one executable per distinct T (2), found {fn._cache_size()}"
    # The custom call carries the same attributes for every T: no kernel is specialised on the shape.
    attrs = []
    for T in (1, 4, 512):
        ids = jax.ShapeDtypeStruct((R * T, 24), jnp.int32, sharding=NamedSharding(mesh, P(AX, None)))
        tok = jax.ShapeDtypeStruct((R,), jnp.int32, sharding=NamedSharding(mesh, P(AX)))
        m = _FETCH_ATTRS.findall(fn.lower(ids, tok).as_text())
        assert len(m) == 1, f"fetch custom call not found in the lowered program for T={T}"
        attrs.append(m[0])
    assert len(set(attrs)) == 1, f"fetch attributes depend on T: {attrs}"


@case("fetch_before_write_and_T0", ("full",))
def _():
    N, H = 8, 64
    t = new_table(N, H, F32, "host")
    ids = make_ids(91, R * 3, 4, t.total_entries)
    data, _ = t.lookup_global(sharded(ids), mode="clip")
    assert_global_equal(data, np.zeros((R * 3, 4 * H), np.float32), "lookup of a never-written table")
    x, _ = make_table_data(92, N, H, F32, 0)
    t.write_global(x)
    data, _ = t.lookup_global(np.zeros((0, 4), np.int32))
    assert data.shape == (0, 4 * H), data.shape


@case("reservation_carving_and_errors", ("full", "core"))
def _():
    c2 = je.init(mesh, AX, device_bytes=1 << 20, host_bytes=1 << 20, timeout_s=120.0)
    try:
        for placement, knob in (("device", "device_bytes"), ("host", "host_bytes")):
            try:
                new_table(1 << 14, 128, BF16, placement, c=c2)  # 4 MiB > 1 MiB reservation
            except MemoryError as e:
                msg = str(e)
                assert str((1 << 14) * 256) in msg and knob in msg, f"message lacks bytes/knob: {msg}"
            else:
                raise AssertionError(f"a 4 MiB {placement} table fit in a 1 MiB reservation")
        # tables carved from the reservations (alloc 0 of the window) work
        N, H = 100, 128
        for placement in ("device", "host"):
            t = new_table(N, H, BF16, placement, c=c2)
            assert t.region.alloc_id == 0, t.region
            x, _ = make_table_data(len(placement), N, H, BF16, 0)
            t.write_global(x)
            check_lookups(t, x, None, 3, T=4, E=24, modes=("fill",))
        # the scale-factor table needs room too, and says so
        try:
            new_table(N, H, FP8, "host", packs=(4 << 20) // (4 * N * R) + 1, c=c2)  # > 2 MiB (segment-aligned)
        except MemoryError as e:
            assert "scale-factor" in str(e) and "device_bytes" in str(e), str(e)
        else:
            raise AssertionError("an oversized sf table fit in the device reservation")
    finally:
        c2.close()


def _raises(fn, exc, *needles):
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


@case("validation_errors", ("full", "core", "quick"))
def _():
    t = new_table(16, 64, BF16, "device")
    t8 = new_table(16, 64, FP8, "device", packs=1)

    def in_sm(fn, *a, specs=None):
        specs = specs or tuple(P() for _ in a)
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)).lower(*a)

    x = jnp.zeros((16, 64), jnp.bfloat16)
    ids = jnp.zeros((2, 3), jnp.int32)
    _raises(lambda: new_table(16, 64, FP8, "device"), ValueError, "num_sf_packs")
    _raises(lambda: new_table(16, 64, jnp.int8, "device"), TypeError, "dtype")
    _raises(lambda: new_table(0, 64, BF16, "device"), ValueError, "num_entries")
    _raises(lambda: new_table(16, 64, BF16, "gpu"), ValueError, "placement")
    _raises(lambda: new_table(16, 64, FP8, "device", packs=1, sf_dtype=np.float16), TypeError, "sf_dtype")
    _raises(lambda: in_sm(lambda a: t.write(a), jnp.zeros((15, 64), jnp.bfloat16)), ValueError, "storage",
            "[16, 64]")
    _raises(lambda: in_sm(lambda a: t.write(a), jnp.zeros((16, 64), jnp.float32)), TypeError, "storage dtype")
    _raises(lambda: in_sm(lambda a: t.write(a, jnp.zeros((R * 16, 1), jnp.float32)), x), ValueError, "sf given")
    _raises(lambda: in_sm(lambda a: t8.write(a), x.astype(FP8)), ValueError, "pass sf")
    _raises(lambda: in_sm(lambda a, s: t8.write(a, s), x.astype(FP8), jnp.zeros((R * 16 + 1, 1), jnp.float32)),
            ValueError, "sf must be", f"[{R * 16}, 1]")
    _raises(lambda: in_sm(lambda a, s: t8.write(a, s), x.astype(FP8), jnp.zeros((R * 16, 1), jnp.int32)),
            TypeError, "sf dtype")
    _raises(lambda: in_sm(lambda i: t.lookup(i, mode="wrap")[0], ids), ValueError, "mode")
    _raises(lambda: in_sm(lambda i: t8.lookup(i, sf_layout="col")[0], ids), ValueError, "sf_layout")
    _raises(lambda: in_sm(lambda i: t.lookup(i)[0], ids.astype(jnp.float32)), TypeError, "indices")
    _raises(lambda: in_sm(lambda i: t.lookup(i)[0], jnp.zeros((6,), jnp.int32)), ValueError, "indices", "[num_tokens, ids_per_token]")
    _raises(lambda: in_sm(lambda i: t.wait(i), ids), TypeError, "EngramPending")
    _raises(lambda: t.lookup(ids), ValueError, "shard_map")
    _raises(lambda: t.write_global(np.zeros((R * 16 + 1, 64), BF16)), ValueError, "whole table")
    _raises(lambda: t.lookup_global(np.zeros((5,), np.int32)), ValueError, "[num_tokens, ids_per_token]")


@case("handler_validation", ("full", "core", "quick"))
def _():
    # Handler-level checks (handlers/engram_validate.h, shared by both backends): the Python layer always passes
    # consistent sizes, so one is made wrong on its way to ffi_call; the handler must refuse it and say why. Own
    # context: a refused write or fetch must not disturb the shared one.
    from jax_engram import _call
    real = _call.call

    def run(target, change, fn, *needles):
        def patched(ctx_, tgt, results, *ops, **attrs):
            if tgt == target:
                results, attrs = change(results, attrs)
            return real(ctx_, tgt, results, *ops, **attrs)
        _call.call = patched
        try:
            _raises(fn, Exception, *needles)
        finally:
            _call.call = real

    c2 = je.init(mesh, AX, timeout_s=120.0)
    try:
        N, H = 16, 64
        x, _ = make_table_data(7, N, H, BF16, 0)
        ids = np.zeros((R * 3, 2), np.int32)
        # a table per check: each table keeps its jitted write / lookup, traced with the changed call
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_write", lambda r, a: (r, {**a, "num_entries": a["num_entries"] + 1}),
            lambda: jax.block_until_ready(t.write_global(x)), "storage has", "the table shard needs")

        def wider_data(r, a):
            d = r[0]
            return (d.update(shape=(d.shape[0], d.shape[1] + 1)),) + tuple(r[1:]), a

        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_fetch", wider_data, lambda: jax.block_until_ready(t.lookup_global(sharded(ids))),
            "data result has", "T*E*row_bytes")
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_fetch", lambda r, a: (r, {**a, "mode": 7}),
            lambda: jax.block_until_ready(t.lookup_global(sharded(ids))), "bad mode 7")
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_fetch", lambda r, a: (r, {**a, "gather": 5}),
            lambda: jax.block_until_ready(t.lookup_global(sharded(ids))), "bad gather 5")
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_fetch", lambda r, a: (r, {**a, "gather_sms": 0}),
            lambda: jax.block_until_ready(t.lookup_global(sharded(ids))), "gather_sms 0")
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_fetch", lambda r, a: (r, {**a, "tma_smem_bytes": 1 << 31}),
            lambda: jax.block_until_ready(t.lookup_global(sharded(ids))), "tma_smem_bytes 2147483648 is not in")
        t = new_table(N, H, BF16, "device", c=c2)  # the context still works after the refused calls
        t.write_global(x)
        got, _ = t.lookup_global(sharded(ids))
        want, _ = reference_lookup(x, None, ids, t.num_entries, "fill", "row")
        assert_global_equal(got, want, "lookup after the refused calls")
    finally:
        c2.close()


@case("checked_out_of_range", ("full", "core", "quick"))
def _():
    # Own context, so that a regression (an error that poisons its context) cannot spill into the other cases.
    c3 = je.init(mesh, AX, timeout_s=120.0)
    try:
        N, H, E, T = 16, 64, 5, 3
        t = new_table(N, H, BF16, "device", c=c3)
        x, _ = make_table_data(101, N, H, BF16, 0)
        t.write_global(x)
        ids = make_ids(102, R * T, E, t.total_entries, special=False)
        data, _ = t.lookup_global(sharded(ids), mode="checked")  # valid ids: no error
        assert_global_equal(data, reference_lookup(x, None, ids, N, "checked", "row")[0], "checked, valid ids")
        c3.check()
        bad = t.total_entries + 3
        for r in range(R):  # every rank: a padding id first (fine), then the first bad one at flat position E+2
            ids[r * T, 0] = -1
            ids[r * T + 1, 2] = bad
            ids[r * T + 2, 4] = bad + 1
        err = None
        try:
            t.lookup_global(sharded(ids), mode="checked")
        except je.JaxEngramError as e:  # raised by the call itself, on every backend
            err = e
        assert err is not None, "an out-of-range id in mode='checked' raised nothing"
        msg = str(err)
        assert f"id {bad}" in msg and f"position {E + 2}" in msg, f"error does not name the id/position: {msg}"
        # The table and the context stay usable: the next lookups are exact and nothing is recorded.
        ids = make_ids(103, R * T, E, t.total_entries, special=False)
        data, _ = t.lookup_global(sharded(ids), mode="checked")
        assert_global_equal(data, reference_lookup(x, None, ids, N, "checked", "row")[0], "checked after an error")
        c3.check()
    finally:
        try:
            c3.close()
        except Exception:  # noqa: BLE001 - a poisoned context may complain while closing
            pass


# ------------------------------------------------------------------------------------------- main
def main():
    sel = [(n, f) for n, s, f in CASES if args.suite in s and (args.only is None or args.only in n)]
    if args.list:
        for n, _ in sel:
            print(n)
        return 0
    info = dict(platform=PLATFORM, ranks=R, processes=jax.process_count(), local_devices=jax.local_device_count(),
                suite=args.suite, gather=args.gather, config=str(CONFIG))
    print(f"engram_check: {info}", flush=True)
    passed, failed, times = [], {}, {}
    for name, fn in sel:
        t0 = time.perf_counter()
        try:
            fn()
            ctx.check()
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"FAIL {name}: {failed[name]}", flush=True)
            traceback.print_exc()
        else:
            passed.append(name)
            print(f"PASS {name} ({time.perf_counter() - t0:.2f}s)", flush=True)
        times[name] = round(time.perf_counter() - t0, 3)
    ctx.close()
    print(f"SUMMARY engram_check: {len(passed)} passed, {len(failed)} failed ({PLATFORM}, {R} ranks, "
          f"{jax.process_count()} processes, suite {args.suite}){': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    emit_result(dict(info, passed=passed, failed=failed, times=times))
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    shutdown()
    sys.exit(rc)
