"""Hierarchical (node, local) EP groups: every result bit-exact against jax_engram.reference over the global
ranks (node-major), on CPU devices or GPUs, 1..N processes.

The mesh is (nodes, local) with axes ("node", "gpu"); a node is a set of devices of one process row (under the
launcher with one device per process and --nodes = processes, every process is a node). Prints ``PASS name`` /
``FAIL name: why`` per case and ends with ``launch = import_launch()
launch.emit_result({"checks": {name: bool}, ...})``.

Run:
  one process:         python tests/workers/scaleout_check.py --platform cpu --cpu-devices 4 --nodes 2
  under the launcher:  python -m jax_engram.launch -n 2 --devices-per-process 2 tests/workers/scaleout_check.py --nodes 2
"""
from __future__ import annotations

import argparse
import os
import sys

from _harness import Checks, assert_same, import_launch, load_example, make_ids, random_bits, shard, start

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda"])
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--nodes", type=int, required=True)
ap.add_argument("--suite", default="engram,ep")
ap.add_argument("--only", default=None, help="comma-separated substrings of the check names to run")
args = ap.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
cfg = start(args.platform, args.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import reference  # noqa: E402

AXES = ("node", "gpu")
DEVS = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
R = len(DEVS)
NODES = args.nodes
L = R // NODES
assert NODES * L == R, f"{R} devices do not split into {NODES} nodes"
mesh = jax.sharding.Mesh(np.array(DEVS).reshape(NODES, L), AXES,
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
SPEC = P(AXES)
BF16, F32, FP8 = np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(ml_dtypes.float8_e4m3fn)
ctx = je.init(mesh, AXES, timeout_s=120.0)
flat_mesh = jax.sharding.Mesh(np.array(DEVS), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))

checks = Checks(style="PASS", decimals=1,
                select=lambda name: not args.only or any(o in name for o in args.only.split(",")))
check = checks.case
CHECKS = checks.results


def sharded(a, spec=None):
    return shard(a, mesh, spec if spec is not None else P(AXES, *([None] * (a.ndim - 1))))


def assert_equal(got, want, what):
    """got: a global jax.Array (sharded like want's leading axis) or numpy; want: numpy."""
    assert_same(got, want, what)


# -------------------------------------------------------------------------------------------- context
@check("context_info_and_mappings")
def _():
    info = ctx.info()
    assert info["nodes"] == NODES and info["ranks_per_node"] == L and info["num_ranks"] == R, info
    assert info["inter_node_path"] == "xla all_to_all", info
    # No GIN here: CPU, one node, or a GPU build/network without it; the reason is stated, never an error.
    assert info["gin"].startswith("not used: ") and len(info["gin"]) > len("not used: "), info
    inner = ctx.inner
    # A member maps the windows of its own node's ranks only (count the peer mappings of the window).
    for m in inner.members:
        peers = inner._native.alloc_info(inner.id, m.ordinal, 0)["peers"]
        assert len(peers) == L and all(p != 0 for p in peers), (m, peers)
        node_of = {d.id: n for n in range(NODES) for d in mesh.devices[n]}
        assert inner._groups[m.group].tolist() == list(mesh.devices[node_of[m.device.id]]), m


# --------------------------------------------------------------------------------------------- Engram
def _ref_lookup(shards, ids, *, mode="fill", sf_table=None, sf_layout="row"):
    """jax_engram.reference.engram_lookup's semantics in numpy (XLA:CPU may flush bf16 subnormals inside the
    jitted reference's fusions; a table copy must keep every bit)."""
    Rr, N, H = shards.shape
    total = Rr * N
    g = np.minimum(ids, total - 1) if mode == "clip" else ids
    valid = (g >= 0) & (g < total)
    T, E = ids.shape
    flat = np.concatenate([shards.reshape(total, H), np.zeros((1, H), shards.dtype)])
    data = flat[np.where(valid, g, total)].reshape(T, E * H)
    if sf_table is None:
        return data, None
    sft = np.concatenate([sf_table, np.zeros((1, sf_table.shape[1]), sf_table.dtype)])
    s = sft[np.where(valid, g, total)].reshape(T, -1)
    if sf_layout == "row":
        return data, s
    Tp = (T + 3) // 4 * 4
    return data, np.pad(s.T, ((0, 0), (0, Tp - T)))


def engram_case(dt, placement, packs, T, E, modes=("fill", "clip"), layouts=("row",), N=24, H=32, seed=0):
    rng = np.random.default_rng(seed)
    t = je.EngramTable(N, H, dt, ctx=ctx, placement=placement, num_sf_packs=packs)
    x = random_bits(rng, (R * N, H), dt)
    sf = random_bits(rng, (R * N, packs), np.float32) if packs else None
    t.write_global(x, sf)
    check_table(t, x, sf, rng, T, E, modes, layouts)
    return t, x, sf


def check_table(t, x, sf, rng, T, E, modes=("fill", "clip"), layouts=("row",)):
    """Sharded lookups of t (every rank's own ids) bit-exact against the table x [R*N, H] and its sf."""
    N, H, packs = t.num_entries, t.hidden, t.num_sf_packs
    for mode in modes:
        ids = make_ids(rng, R * T, E, t.total_entries)
        for layout in layouts:
            data, s = t.lookup_global(sharded(ids), mode=mode, sf_layout=layout)
            for r, blk in enumerate(np.split(ids, R)):
                wd, ws = _ref_lookup(x.reshape(R, N, H), blk, mode=mode, sf_table=sf, sf_layout=layout)
                dsh = [sh for sh in data.addressable_shards if sh.index[0].start == r * T]
                for sh in dsh:
                    assert_equal(np.asarray(sh.data), np.asarray(wd), f"data rank {r} mode={mode}")
                if packs:
                    rows = s.shape[0] // R
                    for sh in s.addressable_shards:
                        if sh.index[0].start == r * rows:
                            assert_equal(np.asarray(sh.data), np.asarray(ws), f"sf rank {r} {mode} {layout}")


if "engram" in args.suite:
    for _dt, _pl, _pk in ((BF16, "host", 0), (BF16, "device", 0), (FP8, "device", 2), (F32, "host", 1)):
        @check(f"engram_{_dt.name}_{_pl}_p{_pk}")
        def _(dt=_dt, pl=_pl, pk=_pk):
            engram_case(dt, pl, pk, T=5, E=3, layouts=("row", "tma_col_major") if pk else ("row",),
                        seed=len(dt.name) * 10 + len(pl) + pk)

    @check("engram_sliced_writes")
    def _():
        # The hierarchical write of part of every shard: write_global streaming a host array in slices, at an int
        # offset, and in shard_map at a traced offset (each node keeps its ranks' scale factors of the slice).
        N, H, packs = 20, 32, 1
        rng = np.random.default_rng(5)
        t = je.EngramTable(N, H, FP8, ctx=ctx, placement="host", num_sf_packs=packs)
        want = random_bits(rng, (R * N, H), FP8)
        want_sf = random_bits(rng, (R * N, packs), np.float32)
        t.WRITE_SLICE_BYTES = 6 * t.row_bytes
        t.write_global(want, want_sf)
        check_table(t, want, want_sf, rng, 5, 3)

        def put(rows, s, start, m):
            for q in range(R):
                want[q * N + start:q * N + start + m] = rows[q * m:(q + 1) * m]
                want_sf[q * N + start:q * N + start + m] = s[q * m:(q + 1) * m]

        rows, s = random_bits(rng, (R * 4, H), FP8), random_bits(rng, (R * 4, packs), np.float32)
        t.write_global(rows, s, row_offset=9)
        put(rows, s, 9, 4)
        check_table(t, want, want_sf, rng, 5, 3)
        f = jax.jit(jax.shard_map(lambda a, b, o: t.write(a, b, row_offset=o).reshape(1), mesh=mesh,
                                  in_specs=(P(AXES, None), P(), P()), out_specs=P(AXES)))
        for off, start in ((2, 2), (50, N - 4)):
            rows, s = random_bits(rng, (R * 4, H), FP8), random_bits(rng, (R * 4, packs), np.float32)
            jax.block_until_ready(f(sharded(rows), sharded(s, P()), sharded(np.int32(off), P())))
            put(rows, s, start, 4)
            check_table(t, want, want_sf, rng, 5, 3, modes=("fill",), layouts=("row", "tma_col_major"))
        t.free()

    @check("engram_in_shard_map_write_fetch_wait_and_T0")
    def _():
        N, H = 16, 8
        rng = np.random.default_rng(1)
        t = je.EngramTable(N, H, F32, ctx=ctx, placement="device")
        x = random_bits(rng, (R * N, H), F32)
        ids = make_ids(rng, R * 4, 2, t.total_entries)

        def body(xs, i):
            tok = t.write(xs)
            pend = t.fetch(i, after=tok)
            d, _ = t.wait(pend)
            d0, _ = t.lookup(i[:0], after=tok)
            return d, d0

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXES, None), P(AXES, None)),
                                  out_specs=(P(AXES, None), P(AXES, None))))
        d, d0 = f(sharded(x), sharded(ids))
        want = np.concatenate([np.asarray(_ref_lookup(x.reshape(R, N, H), b, mode="fill")[0])
                               for b in np.split(ids, R)])
        assert_equal(d, want, "write+fetch+wait in one jit")
        assert d0.shape == (0, 2 * H)

    @check("engram_replicated_ids_and_checked_mode")
    def _():
        N, H = 16, 8
        rng = np.random.default_rng(2)
        t = je.EngramTable(N, H, BF16, ctx=ctx, placement="host")
        x = random_bits(rng, (R * N, H), BF16)
        t.write_global(x)
        ids = make_ids(rng, 7, 3, t.total_entries)
        d, _ = t.lookup_global(ids, mode="clip")
        want = np.asarray(_ref_lookup(x.reshape(R, N, H), ids, mode="clip")[0])
        assert_equal(np.asarray(d.addressable_shards[0].data), want, "replicated ids")
        good = make_ids(rng, R * 3, 2, t.total_entries, special=False)
        d, _ = t.lookup_global(sharded(good), mode="checked")
        assert_equal(d, np.concatenate([np.asarray(_ref_lookup(x.reshape(R, N, H), b, mode="fill")[0])
                                        for b in np.split(good, R)]), "checked mode, valid ids")
        bad = good.copy()
        bad[R * 3 - 1, 1] = t.total_entries + 3  # last rank's last token
        try:
            jax.block_until_ready(t.lookup_global(sharded(bad), mode="checked"))
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            assert "out of range" in msg and f"id {t.total_entries + 3}" in msg and "flat position 5" in msg, msg
        else:
            # Only the process holding the last rank sees the error.
            assert all(d.id != DEVS[-1].id for d in jax.local_devices()), "checked mode did not raise"


# ------------------------------------------------------------------------------------------------- EP
def moe_loss_and_grads(c, m, ax, dtype, params, x, ct, ntok):
    """Per-rank loss and d(x, w_up, w_down) of the example MoE layer (expand dispatch with alignment, zero
    padding, weights, ragged_dot experts, combine), on context c over mesh m / axes ax."""
    mod = load_example()
    E, K, M = params["w_up"].shape[0], 3, x.shape[1]

    def per_rank(w_up, w_down, x, ct, ntok):
        def body(w_up, w_down, x, ct, ntok):
            out = mod.moe_layer({"router": params["router"], "w_up": w_up, "w_down": w_down}, x[0], ctx=c,
                                num_experts=E, top_k=K, max_tokens_per_rank=M, num_tokens=ntok[0])
            return jnp.sum(out.astype(jnp.float32) * ct[0])[None], out[None]
        return jax.shard_map(body, mesh=m, in_specs=P(ax), out_specs=P(ax))(w_up, w_down, x, ct, ntok)

    def loss(w_up, w_down, x, ct, ntok):
        # The loss itself is XLA's reduction of the caller's math (its order may follow fusion); compare the
        # layer's output and the gradients.
        per, out = per_rank(w_up, w_down, x, ct, ntok)
        return jnp.sum(per), out

    sh = lambda a: shard(a, m, P(ax))  # noqa: E731
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (gu, gd, gx), per = f(sh(params["w_up"]), sh(params["w_down"]), sh(x.astype(dtype)), sh(ct), sh(ntok))
    return {"out": per, "d_w_up": gu, "d_w_down": gd, "d_x": gx}


if "ep" in args.suite:
    @check("ep_moe_layer_grads_bit_exact_vs_flat")
    def _():
        rng = np.random.default_rng(7)
        E, H, F, M = max(2 * R, 4), 16, 24, 8
        params = {"router": rng.standard_normal((H, E)).astype(np.float32),
                  "w_up": (rng.standard_normal((E, H, F)) * 0.3).astype(np.float32),
                  "w_down": (rng.standard_normal((E, F, H)) * 0.3).astype(np.float32)}
        x = rng.standard_normal((R, M, H)).astype(np.float32)
        ct = rng.standard_normal((R, M, H)).astype(np.float32)
        ntok = np.array([M - (r % 3) for r in range(R)], np.int32)
        flat = je.init(flat_mesh, "ep", timeout_s=120.0)
        try:
            for dtype in (jnp.float32, jnp.bfloat16):
                got = moe_loss_and_grads(ctx, mesh, AXES, dtype, params, x, ct, ntok)
                want = moe_loss_and_grads(flat, flat_mesh, "ep", dtype, params, x, ct, ntok)
                for k in got:
                    for sg, sw in zip(sorted(got[k].addressable_shards, key=lambda s: s.device.id),
                                      sorted(want[k].addressable_shards, key=lambda s: s.device.id)):
                        assert_equal(np.asarray(sg.data), np.asarray(sw.data), f"{k} {np.dtype(dtype).name}")
        finally:
            flat.close()


# ------------------------------------------------------------------------------------------------ end
print(f"checks: {sum(CHECKS.values())}/{len(CHECKS)} passed", flush=True)
launch = import_launch()
launch.emit_result({"checks": CHECKS, "devices": R, "nodes": NODES, "processes": jax.process_count()})
launch.shutdown()
sys.exit(0 if all(CHECKS.values()) else 1)
