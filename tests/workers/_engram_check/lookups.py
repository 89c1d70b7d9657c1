"""Lookups bit-exact against the reference: every dtype x placement x mode x sf layout, ids per token,
wide and odd-sized rows, replicated ids, non-int32 ids."""
from __future__ import annotations

import zlib

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from _engram_check.common import (AX, BF16, F16, F32, FP8, R, assert_global_equal, case, check_lookups, make_ids,
                                  make_table_data, mesh, new_table, reference_lookup, replicated, sharded)


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


@case("sliced_writes", ("full", "core", "quick"))
def _():
    # A table written a slice at a time: write_global streaming a host array in slices (WRITE_SLICE_BYTES made
    # small), write_global of part of every shard at an int offset, and the in-shard_map write at a traced offset
    # (one compilation for every offset; an offset past the end clamps as lax.dynamic_update_slice clamps). Every
    # state checked bit-exact by lookups of all modes against a numpy copy of the table.
    N = 23
    for placement, dt, H, packs in (("host", FP8, 66, 2), ("device", BF16, 64, 0), ("host", BF16, 100, 0),
                                    ("device", FP8, 128, 1)):
        t = new_table(N, H, dt, placement, packs)
        x, sf = make_table_data(N + H, N, H, dt, packs, t.sf_dtype)
        t.write_global(x, sf)
        x1, sf1 = make_table_data(N + H + 1, N, H, dt, packs, t.sf_dtype)
        t.WRITE_SLICE_BYTES = 5 * t.row_bytes  # slices of 5, 5, 5, 5 and 3 rows per rank
        t.write_global(x1, sf1)
        check_lookups(t, x1, sf1, 31, T=4, E=12)
        want, want_sf = x1.copy(), None if sf1 is None else sf1.copy()

        def put(rows, s, start, m):  # rows [R*m, H], s [R*m, P]: rank q's rows go to its rows start..start+m
            for q in range(R):
                want[q * N + start:q * N + start + m] = rows[q * m:(q + 1) * m]
                if s is not None:
                    want_sf[q * N + start:q * N + start + m] = s[q * m:(q + 1) * m]

        x2, sf2 = make_table_data(N + H + 2, 6, H, dt, packs, t.sf_dtype)  # [R*6, H], [R*6, P]
        t.write_global(sharded(x2), sf2, row_offset=17)  # a jax.Array: one write; the shards' last 6 rows
        put(x2, sf2, 17, 6)
        check_lookups(t, want, want_sf, 32, T=4, E=12, modes=("fill",))

        def body(rows, s, off):
            return t.write(rows, s if packs else None, row_offset=off).reshape(1)

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P(), P()), out_specs=P(AX)))
        x3, sf3 = make_table_data(N + H + 3, 7, H, dt, packs, t.sf_dtype)
        s3 = sf3 if packs else np.zeros((R * 7, 1), np.float32)
        for off, start in ((3, 3), (100, N - 7), (-5, 0)):
            jax.block_until_ready(fn(sharded(x3), replicated(s3), replicated(np.int32(off))))
            put(x3, sf3, start, 7)
            check_lookups(t, want, want_sf, 33 + start, T=4, E=12, modes=("fill", "clip"))
            x3 = x3[::-1].copy()  # the next offset writes other rows
            if packs:
                sf3 = sf3[::-1].copy()
                s3 = sf3
        assert fn._cache_size() == 1, f"the traced row_offset recompiled: {fn._cache_size()} compilations"
        t.free()
