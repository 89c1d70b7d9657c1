"""The gathers and their configurations against each other and the reference; EngramConfig validation and
cache key; one executable per T whose custom-call attributes do not depend on T."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_engram as je

from _engram_check.common import (AX, BF16, F16, F32, FP8, R, assert_global_equal, case, make_ids, make_table_data,
                                  mesh, new_table, reference_lookup, sharded)
from _harness import raises


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
                    d, s2 = t.wait(pend, after=y)
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
    raises(lambda: je.EngramConfig(fetch_gather="dma"), ValueError, "fetch_gather")
    raises(lambda: je.EngramConfig(lookup_gather="x"), ValueError, "lookup_gather")
    raises(lambda: je.EngramConfig(num_sms=0), ValueError, "num_sms")
    raises(lambda: je.EngramConfig(num_sms=True), ValueError, "num_sms")
    raises(lambda: je.EngramConfig(tma_smem_kib=8), ValueError, "tma_smem_kib")
    raises(lambda: je.EngramConfig(sm_loads="ca"), ValueError, "sm_loads")
    raises(lambda: je.EngramConfig(sm_blocks_per_sm=-1), ValueError, "sm_blocks_per_sm")
    raises(lambda: new_table(8, 64, BF16, "device", config="tma"), TypeError, "EngramConfig")
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
