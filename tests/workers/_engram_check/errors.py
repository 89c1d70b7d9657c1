"""Edge cases and errors: lookups before any write and with T = 0, reservations carving and their "too small"
errors, trace-time validation, the handlers' own checks, checked mode out of range."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_engram as je

from _engram_check.common import (AX, BF16, F32, FP8, R, assert_global_equal, case, check_lookups, make_ids,
                                  make_table_data, mesh, new_table, reference_lookup, sharded)
from _harness import raises


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


@case("validation_errors", ("full", "core", "quick"))
def _():
    t = new_table(16, 64, BF16, "device")
    t8 = new_table(16, 64, FP8, "device", packs=1)

    def in_sm(fn, *a, specs=None):
        specs = specs or tuple(P() for _ in a)
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)).lower(*a)

    x = jnp.zeros((16, 64), jnp.bfloat16)
    ids = jnp.zeros((2, 3), jnp.int32)
    raises(lambda: new_table(16, 64, FP8, "device"), ValueError, "num_sf_packs")
    raises(lambda: new_table(16, 64, jnp.int8, "device"), TypeError, "dtype")
    raises(lambda: new_table(0, 64, BF16, "device"), ValueError, "num_entries")
    raises(lambda: new_table(16, 64, BF16, "gpu"), ValueError, "placement")
    raises(lambda: new_table(16, 64, FP8, "device", packs=1, sf_dtype=np.float16), TypeError, "sf_dtype")
    raises(lambda: in_sm(lambda a: t.write(a), jnp.zeros((17, 64), jnp.bfloat16)), ValueError, "storage",
            "[16, 64]")
    raises(lambda: in_sm(lambda a: t.write(a), jnp.zeros((0, 64), jnp.bfloat16)), ValueError, "1 <= n")
    raises(lambda: in_sm(lambda a: t.write(a, row_offset=2), jnp.zeros((15, 64), jnp.bfloat16)), ValueError,
           "row_offset 2", "0 <= row_offset <= 1")
    raises(lambda: in_sm(lambda a: t.write(a, row_offset=-1), jnp.zeros((4, 64), jnp.bfloat16)), ValueError,
           "row_offset -1")
    raises(lambda: in_sm(lambda a: t.write(a, row_offset=True), jnp.zeros((4, 64), jnp.bfloat16)), TypeError,
           "row_offset")
    raises(lambda: in_sm(lambda a: t.write(a, row_offset=jnp.zeros((), jnp.float32)), jnp.zeros((4, 64),
                                                                                               jnp.bfloat16)),
           TypeError, "row_offset", "float32")
    raises(lambda: in_sm(lambda a: t.write(a, row_offset=jnp.zeros((1,), jnp.int32)), jnp.zeros((4, 64),
                                                                                               jnp.bfloat16)),
           TypeError, "row_offset", "[1]")
    raises(lambda: in_sm(lambda a: t.write(a), jnp.zeros((16, 64), jnp.float32)), TypeError, "storage dtype")
    raises(lambda: in_sm(lambda a: t.write(a, jnp.zeros((R * 16, 1), jnp.float32)), x), ValueError, "sf given")
    raises(lambda: in_sm(lambda a: t8.write(a), x.astype(FP8)), ValueError, "pass sf")
    raises(lambda: in_sm(lambda a, s: t8.write(a, s), x.astype(FP8), jnp.zeros((R * 16 + 1, 1), jnp.float32)),
            ValueError, "sf must be", f"[{R * 16}, 1]")
    raises(lambda: in_sm(lambda a, s: t8.write(a, s), x.astype(FP8), jnp.zeros((R * 16, 1), jnp.int32)),
            TypeError, "sf dtype")
    raises(lambda: in_sm(lambda i: t.lookup(i, mode="wrap")[0], ids), ValueError, "mode")
    raises(lambda: in_sm(lambda i: t8.lookup(i, sf_layout="col")[0], ids), ValueError, "sf_layout")
    raises(lambda: in_sm(lambda i: t.lookup(i)[0], ids.astype(jnp.float32)), TypeError, "indices")
    raises(lambda: in_sm(lambda i: t.lookup(i)[0], jnp.zeros((6,), jnp.int32)), ValueError, "indices", "[num_tokens, ids_per_token]")
    raises(lambda: in_sm(lambda i: t.wait(i), ids), TypeError, "EngramPending")
    raises(lambda: t.lookup(ids), ValueError, "shard_map")
    raises(lambda: t.write_global(np.zeros((R * 16 + 1, 64), BF16)), ValueError, "whole table")
    raises(lambda: t.write_global(np.zeros((R * 17, 64), BF16)), ValueError, "1 <= n <= num_entries")
    raises(lambda: t.write_global(np.zeros((R * 4, 64), BF16), row_offset=13), ValueError, "row_offset 13",
           "0 <= row_offset <= 12")
    raises(lambda: t.write_global(np.zeros((R * 4, 64), BF16), row_offset=np.int32(1).astype(float)), TypeError,
           "row_offset")
    raises(lambda: t8.write_global(np.zeros((R * 4, 64), FP8), np.zeros((R * 16, 1), np.float32)), ValueError,
           f"[{R * 4}, 1]")
    raises(lambda: t.lookup_global(np.zeros((5,), np.int32)), ValueError, "[num_tokens, ids_per_token]")


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
            raises(fn, Exception, *needles)
        finally:
            _call.call = real

    c2 = je.init(mesh, AX, timeout_s=120.0)
    try:
        N, H = 16, 64
        x, _ = make_table_data(7, N, H, BF16, 0)
        ids = np.zeros((R * 3, 2), np.int32)
        # a table per check: each table keeps its jitted write / lookup, traced with the changed call
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_write", lambda r, a: (r, {**a, "num_entries": a["num_entries"] - 1}),
            lambda: jax.block_until_ready(t.write_global(x)), "storage has 16 rows", "1 to num_entries = 15")
        t = new_table(N, H, BF16, "device", c=c2)
        run("jax_engram_engram_write", lambda r, a: (r, {**a, "row_bytes": a["row_bytes"] + 1}),
            lambda: jax.block_until_ready(t.write_global(x)), "not a whole number of 129-byte rows")

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
