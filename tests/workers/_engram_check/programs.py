"""Engram ops inside one jitted program: write -> fetch, a second write replacing the table, fetch / XLA work /
wait."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from _engram_check.common import (AX, BF16, F16, FP8, R, assert_global_equal, case, make_ids, make_table_data, mesh,
                                  new_table, reference_lookup, replicated, sharded)


@case("write_fetch_one_jit", ("full", "core", "quick"))
def _():
    N, H, packs = 32, 128, 1
    t = new_table(N, H, FP8, "host", packs)

    def body(xl, sf, ids):
        tok = t.write(xl, sf)
        data, s = t.lookup(ids, after=tok, sf_layout="tma_col_major")
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
    # separate calls (global API, chained by the table itself)
    for x in (xa, xb, xa):
        t.write_global(x)
        data, _ = t.lookup_global(sharded(ids))
        assert_global_equal(data, reference_lookup(x, None, ids, N, "fill", "row")[0], "global write/lookup")

    # one program: write A, look up, write B after the lookup (after= its data), look up again
    def body(a, b, i):
        da, _ = t.wait(t.fetch(i, after=t.write(a)))  # overlapped fetch (GPU side stream), then a write after it
        db, _ = t.lookup(i, after=t.write(b, after=da))
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
        data, _ = t.wait(pend, after=y)  # the wait comes after the work
        return data, y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P(AX, None)),
                              out_specs=(P(AX, None), P(AX, None))))
    y0 = np.ones((R * 8, 8), np.float32)
    data, _ = f(sharded(ids), sharded(y0))
    assert_global_equal(data, reference_lookup(x, None, ids, N, "clip", "row")[0], "fetch/work/wait")
