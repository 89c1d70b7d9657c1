"""The hierarchical (node, local) path at 2 nodes x 1 against the flat path on the same two devices, in one run.

For an Engram lookup and a MoE step (dispatch -> combine, non-expand, bf16) per rank, each timed per call inside
one jitted ``lax.fori_loop`` (slope of n and 3n calls):

* ``flat``: the op on a flat context over a 1-D axis of the two devices;
* ``hier``: the same op on ``je.init(mesh, ("node", "gpu"))`` with a (2, 1) mesh (every cross-"node" byte goes
  through XLA's ``all_to_all`` over the node axis);
* ``inter``: the hierarchical path's inter-node leg alone (the same ``all_to_all`` calls with the same shapes);
* ``bare``: one bare XLA ``all_to_all`` over the flat axis moving the same bytes as ``inter``;
* ``bare_ragged``: ``jax.lax.ragged_all_to_all`` moving the same bytes (the exact-size primitive the leg could use
  instead of static capacity; XLA:CPU does not implement it, and the row says so);
* ``intra``: the hierarchical path with its inter-node exchanges replaced by local copies (the intra-node ops
  and the on-device reordering alone).

Printed ratios: hier / flat, inter / bare (goal on GPUs: <= 1.15), hier / (inter + intra) (goal: <= 1.10),
bare_ragged / bare.
On CPU the numbers only prove the plumbing; GPU numbers come with a two-GPU run.

    python benchmarks/bench_scaleout.py [--tokens 128] [--hidden 7168] [--ids 64] [--loop 10] [--out s.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _common as C  # noqa: E402
import jax_engram as je  # noqa: E402

HAX = ("node", "gpu")


def _a2a_bytes(shapes_dtypes, nodes):
    """Bytes one rank sends to other nodes in node_all_to_all calls of these [nodes, ...] shapes."""
    return sum(int(np.prod(s)) * np.dtype(d).itemsize * (nodes - 1) // nodes for s, d in shapes_dtypes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="MoE tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ids", type=int, default=64, help="Engram lookups per rank (T, with E ids each)")
    ap.add_argument("--ids-per-token", type=int, default=8, help="E")
    ap.add_argument("--engram-hidden", type=int, default=512)
    ap.add_argument("--entries", type=int, default=4096, help="Engram rows per rank")
    ap.add_argument("--loop", type=int, default=10)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    devs = jax.devices()[:2]
    if len(devs) < 2:
        print("bench_scaleout: needs 2 devices", file=sys.stderr)
        return 2
    Nn = 2
    fmesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devs)
    hmesh = jax.sharding.Mesh(np.array(devs).reshape(2, 1), HAX, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    N, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    T, Ei, Hg, Ne = args.ids, args.ids_per_token, args.engram_hidden, args.entries
    C.config_line(nodes=2, ranks_per_node=1, tokens=N, hidden=H, topk=K, experts=E, dtype="bfloat16",
                  engram_ids=f"{T}x{Ei}", engram_hidden=Hg, engram_entries=Ne, loop=args.loop, iters=args.iters)
    flat = je.init(fmesh, "ep")
    hier = je.init(hmesh, HAX)
    print(f"hierarchical context: {hier.info()['nodes']} nodes x {hier.info()['ranks_per_node']}, inter-node path: "
          f"{hier.info()['inter_node_path']}", flush=True)
    rng = np.random.default_rng(0)
    rows = []

    def timed(step, carry):
        return C.time_loop_per_call(step, carry, args.loop, iters=args.iters)["median_us"]

    def put(a, mesh, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    def bare_step(nbytes):
        """One all_to_all over the flat axis sending `nbytes` per rank to the other devices."""
        chunk = max(1, nbytes // (Nn - 1))

        def body(b):
            return jax.lax.all_to_all(b[0], "ep", 0, 0, tiled=True)[None] + jnp.uint8(1)
        f = jax.shard_map(body, mesh=fmesh, in_specs=P("ep"), out_specs=P("ep"))
        return f, put(np.zeros((2, Nn * chunk), np.uint8), fmesh, P("ep"))

    def bare_ragged_us(nbytes):
        """One jax.lax.ragged_all_to_all over the flat axis moving the same bytes as bare_step (exact sizes: the
        primitive the inter-node leg could use instead of a static-capacity all_to_all), or the error string
        where the platform does not implement it (XLA:CPU)."""
        chunk = max(1, nbytes // (Nn - 1))

        def body(b, out):
            me = jax.lax.axis_index("ep")
            off = jnp.arange(Nn, dtype=jnp.int32) * chunk
            sizes = jnp.full((Nn,), chunk, jnp.int32)
            r = jax.lax.ragged_all_to_all(b[0], out[0], off, sizes, jnp.full((Nn,), me * chunk, jnp.int32), sizes,
                                          axis_name="ep")
            return b + jnp.uint8(1), r[None]
        f = jax.shard_map(body, mesh=fmesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"), P("ep")))
        z = put(np.zeros((2, Nn * chunk), np.uint8), fmesh, P("ep"))
        try:
            return timed(lambda c: f(*c), (z, z)), None
        except Exception as e:  # noqa: BLE001 - XLA:CPU has no ragged all-to-all
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    try:
        # ------------------------------------------------------------------------------------ MoE step
        x = rng.standard_normal((2, N, H)).astype(jnp.bfloat16)
        tk = np.argsort(rng.random((2, N, E)), axis=-1)[..., :K].astype(np.int32)

        def moe_step(ctx, mesh, spec):
            def body(xl, tkl):
                d = je.dispatch(xl[0], tkl[0], ctx=ctx, num_experts=E, max_tokens_per_rank=N)
                c = je.combine(d.recv_x, d.handle).combined_x
                return (c.astype(jnp.float32) * (1.0 / K)).astype(jnp.bfloat16)[None]
            f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
            return lambda c: (f(*c), c[1])

        S = min(K, hier.local_size)
        moe_legs = [((Nn, N, H), jnp.bfloat16), ((Nn, N, K), jnp.int32), ((Nn, N, S, H), jnp.bfloat16)]

        def moe_inter(c):
            def body(xl, tkl):
                a = hier.node_all_to_all(jnp.broadcast_to(xl[0][None], (Nn, N, H)))
                b = hier.node_all_to_all(jnp.broadcast_to(tkl[0][None], (Nn, N, K)))
                r = hier.node_all_to_all(jnp.broadcast_to(a[:, :, None], (Nn, N, S, H)))
                return r[0, :, 0][None], b[0][None]
            f = jax.shard_map(body, mesh=hmesh, in_specs=(P(HAX), P(HAX)), out_specs=(P(HAX), P(HAX)))
            return f(*c)

        xf, tkf = put(x, fmesh, P("ep")), put(tk, fmesh, P("ep"))
        xh, tkh = put(x, hmesh, P(HAX)), put(tk, hmesh, P(HAX))
        nbytes = _a2a_bytes(moe_legs, Nn)
        bf, bb = bare_step(nbytes)
        row = dict(op="moe dispatch+combine", inter_bytes_per_rank=nbytes,
                   flat_us=timed(moe_step(flat, fmesh, P("ep")), (xf, tkf)),
                   hier_us=timed(moe_step(hier, hmesh, P(HAX)), (xh, tkh)),
                   inter_us=timed(moe_inter, (xh, tkh)),
                   bare_us=timed(lambda b: bf(b), bb))
        row["bare_ragged_us"], row["ragged_error"] = bare_ragged_us(nbytes)
        row["intra_us"] = _without_inter(hier, lambda: timed(moe_step(hier, hmesh, P(HAX)), (xh, tkh)))
        rows.append(row)

        # ------------------------------------------------------------------------------ Engram lookup
        tabs = {"flat": je.EngramTable(Ne, Hg, jnp.bfloat16, ctx=flat, placement="device"),
                "hier": je.EngramTable(Ne, Hg, jnp.bfloat16, ctx=hier, placement="device")}
        table = rng.standard_normal((2 * Ne, Hg)).astype(jnp.bfloat16)
        for t in tabs.values():
            t.write_global(table)
        ids = rng.integers(0, 2 * Ne, size=(2, T, Ei)).astype(np.int32)

        def engram_step(t, mesh, spec):
            def body(il, acc):
                d, _ = t.lookup(il[0])
                return il, acc + d[:1].astype(jnp.float32)[None]
            f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))
            return lambda c: f(*c)

        eng_legs = [((Nn, T, Ei), jnp.int32), ((Nn, T, Ei, Hg), jnp.bfloat16)]

        def eng_inter(c):
            def body(il, acc):
                q = hier.node_all_to_all(jnp.broadcast_to(il[0][None], (Nn, T, Ei)))
                r = hier.node_all_to_all(jnp.broadcast_to(q[..., None].astype(jnp.bfloat16), (Nn, T, Ei, Hg)))
                return il, acc + r[0].reshape(T, Ei * Hg)[:1].astype(jnp.float32)[None]
            f = jax.shard_map(body, mesh=hmesh, in_specs=(P(HAX), P(HAX)), out_specs=(P(HAX), P(HAX)))
            return f(*c)

        acc = np.zeros((2, 1, Ei * Hg), np.float32)
        cf = (put(ids, fmesh, P("ep")), put(acc, fmesh, P("ep")))
        ch = (put(ids, hmesh, P(HAX)), put(acc, hmesh, P(HAX)))
        nbytes = _a2a_bytes(eng_legs, Nn)
        bf, bb = bare_step(nbytes)
        row = dict(op="engram lookup", inter_bytes_per_rank=nbytes,
                   flat_us=timed(engram_step(tabs["flat"], fmesh, P("ep")), cf),
                   hier_us=timed(engram_step(tabs["hier"], hmesh, P(HAX)), ch),
                   inter_us=timed(eng_inter, ch), bare_us=timed(lambda b: bf(b), bb))
        row["bare_ragged_us"], row["ragged_error"] = bare_ragged_us(nbytes)
        row["intra_us"] = _without_inter(hier, lambda: timed(engram_step(tabs["hier"], hmesh, P(HAX)), ch))
        rows.append(row)
        flat.check()
        hier.check()
    finally:
        flat.close()
        hier.close()

    for r in rows:
        r["hier_over_flat"] = r["hier_us"] / r["flat_us"]
        r["inter_over_bare"] = r["inter_us"] / r["bare_us"]
        r["hier_over_inter_plus_intra"] = r["hier_us"] / (r["inter_us"] + r["intra_us"])
        r["ragged_over_bare"] = r["bare_ragged_us"] / r["bare_us"] if r["bare_ragged_us"] else None
    C.print_table(rows, ["op", "flat_us", "hier_us", "inter_us", "bare_us", "bare_ragged_us", "intra_us",
                         "inter_bytes_per_rank",
                         "hier_over_flat", "inter_over_bare", "hier_over_inter_plus_intra"],
                  title="hierarchical (2 nodes x 1) vs flat, per call (us)")
    for r in rows:
        print(f"{r['op']}: hier/flat {r['hier_over_flat']:.2f}x, inter-node leg / bare all_to_all "
              f"{r['inter_over_bare']:.2f}x (goal <= 1.15 on GPUs), hier / (inter + intra) "
              f"{r['hier_over_inter_plus_intra']:.2f}x (goal <= 1.10)", flush=True)
        print(f"{r['op']}: the same bytes by ragged_all_to_all / all_to_all: "
              + (f"{r['ragged_over_bare']:.2f}x" if r["ragged_over_bare"] else f"n/a ({r['ragged_error']})"),
              flush=True)
    if args.out:
        C.write_json(args.out, dict(config=C.shown_args(args), env=C.env_info(), rows=rows))
    return 0


def _without_inter(hier, run):
    """Run `run` with the context's inter-node exchanges replaced by local copies (same shapes): the intra-node
    leg and the on-device reordering alone. Traces inside `run` see the replacement; results are meaningless."""
    orig = hier.node_all_to_all
    hier.node_all_to_all = lambda x: hier.varying(x) + jnp.zeros((), x.dtype)
    try:
        return run()
    finally:
        hier.node_all_to_all = orig


if __name__ == "__main__":
    sys.exit(main())
