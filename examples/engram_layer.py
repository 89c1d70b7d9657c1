"""An Engram memory layer on jax_engram: hashed n-gram ids -> sharded table lookup -> gated add.

Every token's 2- and 3-grams are hashed by a few hash heads each (``jax_engram.layers.EngramHashing``); each
(order, head) pair reads one row of a table that is sharded over the ranks of the context (``placement``:
``"host"`` memory or ``"device"`` HBM); the rows, concatenated, are gated into the hidden state.

The example writes a table, runs ``jax_engram.engram_layer`` on global arrays (it opens its own shard_map),
takes gradients with respect to the hidden state and the gate's projections, and checks both against the
pure-JAX twin ``jax_engram.layers.engram_layer_reference`` (the lookup by ``jax_engram.reference``). The same
layer as a Flax NNX module is ``jax_engram.nn.EngramMemory``.

Run: ``python examples/engram_layer.py [--devices 4] [--placement host|device]`` (CPU devices by default);
exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def run(ctx, *, placement: str, seqs_per_rank: int = 2, seq_len: int = 16, hidden: int = 32,
        memory_dim: int = 8, buckets_per_head: int = 256, verbose: bool = True) -> bool:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_engram as je
    from jax_engram import layers as L

    R, ax = ctx.num_ranks, ctx.axis_name
    hashing = je.EngramHashing(orders=(2, 3), heads_per_order=2)
    rows = buckets_per_head * hashing.num_heads
    num_entries = -(-rows // R)

    # The table: rank r holds rows r*num_entries .. (r+1)*num_entries - 1 of the global table.
    table = je.EngramTable(num_entries, memory_dim, jnp.bfloat16, ctx=ctx, placement=placement)
    rng = np.random.default_rng(0)
    table_rows = rng.standard_normal((R * num_entries, memory_dim)).astype(jnp.bfloat16)
    table.write_global(table_rows)

    params = L.init_engram_params(jax.random.key(1), hidden=hidden, memory_dim=memory_dim,
                                  num_heads=hashing.num_heads)
    B = seqs_per_rank * R
    x = rng.standard_normal((B, seq_len, hidden)).astype(np.float32)
    token_ids = rng.integers(0, 1000, (B, seq_len)).astype(np.int32)
    ct = rng.standard_normal((B, seq_len, hidden)).astype(np.float32)

    def ours(p, x):
        return je.engram_layer(p, x, token_ids_g, table=table, hashing=hashing)

    def theirs(p, x):
        return L.engram_layer_reference(p, x, token_ids, table_rows=table_rows, num_ranks=R, hashing=hashing)

    token_ids_g = L.put_global(token_ids, ctx, P(ax))
    gp = {k: L.put_global(v, ctx, P()) for k, v in params.items()}
    out, vjp = jax.vjp(ours, gp, L.put_global(x, ctx, P(ax)))
    g_p, g_x = vjp(L.put_global(ct, ctx, P(ax)))
    r_out, r_vjp = jax.vjp(theirs, params, x)
    r_p, r_x = r_vjp(ct)

    ok = True
    for name, a, b in [("output", out, r_out), ("d hidden", g_x, r_x), ("d w_key", g_p["w_key"], r_p["w_key"]),
                       ("d w_value", g_p["w_value"], r_p["w_value"])]:
        err = float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-12))
        ok &= err <= 1e-5
        if verbose:
            print(f"  {name:10s} max |diff| / max |ref| = {err:.1e}")
    ids = L.engram_ids(token_ids, hashing=hashing, total_entries=table.total_entries)
    if verbose:
        print(f"  token 5 of sequence 0 reads global rows {np.asarray(ids[0, 5]).tolist()} "
              f"(owners {[int(i) // num_entries for i in np.asarray(ids[0, 5])]})")
    table.free()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices (single process)")
    ap.add_argument("--placement", default="host,device", help="comma-separated: host, device")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", a.devices)
    try:
        import jax_engram as je
    except ModuleNotFoundError:  # a source checkout that is not installed
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import jax_engram as je

    mesh = jax.make_mesh((a.devices,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    ok_all = True
    with je.init(mesh, "ep") as ctx:
        for placement in a.placement.split(","):
            if not a.quiet:
                print(f"Engram layer on {a.devices} CPU ranks, table placement={placement!r}:")
            ok = run(ctx, placement=placement, verbose=not a.quiet)
            ok_all &= ok
            print(f"{'PASS' if ok else 'FAIL'} engram_layer placement={placement}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
