"""Engram prefetch: the ordering argument of wait under jax.grad, the functional and Flax NNX prefetch API (outside
and inside a user's shard_map, jitted as a whole), the decode form, FP8 + scale factors, the gate's memory_dim
check. One process, CPU devices (--cpu-devices, default 4). Everything is checked against
jax_engram.reference (bit-exact where the computation is the same; float rounding where only the summation
order differs, as said at each check).

Prints `CHECK <name> PASS|FAIL <detail>` lines and one `RESULT <json>` line ({"checks": {name: bool}}).
"""
from __future__ import annotations

import argparse
import json
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="cpu", choices=["cpu", "cuda"], help="cuda: every visible GPU is a rank")
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
ap.add_argument("--list", action="store_true", help="print the check names and exit")
args = ap.parse_args()

import jax  # noqa: E402
import jax.extend  # noqa: E402

if args.platform == "cpu":
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import layers as L  # noqa: E402
from jax_engram import reference as ref  # noqa: E402
from _harness import Checks  # noqa: E402

NAMES = ["wait_after_under_grad", "two_prefetched_layers_grad_vs_reference", "modes_and_padding_through_prefetch",
         "layers_inside_user_shard_map", "nnx_two_memories_prefetch_value_and_grad", "decode_ids_match_full_sequence",
         "decode_prefetch_layer", "dequantize_semantics", "memory_dim_mismatch_raises", "misuse_errors",
         "hierarchical_context_prefetch_grad", "two_prefetched_layers_grad_inside_user_shard_map",
         "decode_prefetch_in_scan", "checked_mode_through_prefetch", "captured_token_ids_in_jit",
         "quantize_roundtrip", "nnx_fp8_memory_prefetch", "prefetch_after_orders_the_fetches"]
if args.list:
    print("\n".join(NAMES))
    sys.exit(0)

R = args.cpu_devices if args.platform == "cpu" else len(jax.devices())
mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
ctx = je.init(mesh, "ep", timeout_s=60.0)
checks = Checks(select=lambda name: (not args.only or name in args.only.split(","))
                and not (name.startswith("hierarchical") and R % 2 == 1))


def check(name):
    assert name in NAMES, name
    return checks.case(name)


def put(a, spec=P("ep")):
    return L.put_global(np.asarray(a), ctx, spec)


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def raises(fn, exc, needle):
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"{exc.__name__} without {needle!r}: {e}"
        return
    raise AssertionError(f"no {exc.__name__} ({needle!r})")


def wait_after_avals(fn, *a):
    """The aval of the ordering operand (the last) of every jax_engram_engram_wait in fn's jaxpr, nested jaxprs
    (shard_map, jit, the linearised forward of a gradient) included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "jax_engram_ffi_call" and e.params["target"] == "jax_engram_engram_wait":
                out.append(e.invars[-1].aval)
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*a).jaxpr)
    return out


rng = np.random.default_rng(0)
B, S, H, VOCAB = 2 * R, 6, 16, 50
H1 = L.EngramHashing(orders=(2, 3), heads_per_order=2, seed=1)
H2 = L.EngramHashing(orders=(2,), heads_per_order=3, seed=2)

# Two tables as two Engram layers of one model: bf16 rows with packed UE8M0 scales (host), FP8 rows with float32
# scales (device).
D1, D2 = 8, 8
T1 = je.EngramTable(32, D1, jnp.bfloat16, ctx=ctx, placement="host", num_sf_packs=1, sf_dtype=np.int32)
T2 = je.EngramTable(24, D2, ml_dtypes.float8_e4m3fn, ctx=ctx, placement="device", num_sf_packs=2)
rows1 = rng.standard_normal((T1.total_entries, D1)).astype(jnp.bfloat16)
sf1 = rng.integers(120, 134, (T1.total_entries, 4)).astype(np.uint8).view(np.int32)  # 4 exponents per pack
rows2 = rng.standard_normal((T2.total_entries, D2)).astype(ml_dtypes.float8_e4m3fn)
sf2 = rng.uniform(0.5, 2.0, (T2.total_entries, 2)).astype(np.float32)
jax.block_until_ready(T1.write_global(rows1, sf1))
jax.block_until_ready(T2.write_global(rows2, sf2))
p1 = L.init_engram_params(jax.random.key(1), hidden=H, memory_dim=D1, num_heads=H1.num_heads)
p2 = L.init_engram_params(jax.random.key(2), hidden=H, memory_dim=D2, num_heads=H2.num_heads)
w_mid = (rng.standard_normal((H, H)) / 4).astype(np.float32)
x_h = rng.standard_normal((B, S, H)).astype(np.float32)
tok_h = rng.integers(0, VOCAB, (B, S)).astype(np.int32)
params_h = {"e1": p1, "e2": p2, "w": w_mid}
params_g = {"e1": {k: put(v, P()) for k, v in p1.items()}, "e2": {k: put(v, P()) for k, v in p2.items()},
            "w": put(w_mid, P())}


def two_layer_loss(engram1, engram2):
    """A 2-layer step: x -> Engram 1 -> tanh(h W) -> Engram 2 -> loss, with the Engram layers given."""
    def loss(p, x, tok):
        h = engram1(p["e1"], x, tok)
        h = jnp.tanh(h @ p["w"])
        h = engram2(p["e2"], h, tok)
        return jnp.sum(h * h)
    return loss


@check("wait_after_under_grad")
def _():
    # fetch(after=h) and wait(after=h) with a differentiated h: both only order; h's gradient is its own (2h),
    # the rows add to the value and are constants.
    ids_h = rng.integers(-1, T1.total_entries, (R * 4, 3)).astype(np.int32)

    def body(h, ids):
        def f(h):
            pend = T1.fetch(ids, after=h)
            data, _ = T1.wait(pend, after=h * 2)
            return jnp.sum(h * h) + jnp.sum(data.astype(jnp.float32))
        v, g = jax.value_and_grad(f)(h)
        _, vjp = jax.vjp(f, h)
        return v.reshape(1), g, vjp(jnp.ones_like(v))[0]

    h = rng.standard_normal((R * 4, 5)).astype(np.float32)
    v, g, gv = smap(body, (P("ep"), P("ep")), (P("ep"), P("ep"), P("ep")))(put(h), put(ids_h))
    data, _ = ref.engram_lookup(rows1.reshape(R, -1, D1), ids_h)
    want = (h * h).reshape(R, -1).sum(1) + np.asarray(data, np.float32).reshape(R, -1).sum(1)
    assert np.allclose(np.asarray(v), want, rtol=1e-6), (np.asarray(v), want)
    assert np.array_equal(np.asarray(g), 2 * h) and np.array_equal(np.asarray(gv), 2 * h)


@check("two_prefetched_layers_grad_vs_reference")
def _():
    def native(p, x, tok):
        pend1 = L.engram_prefetch(T1, tok, hashing=H1)  # both layers' reads start here, before any layer
        pend2 = L.engram_prefetch(T2, tok, hashing=H2)
        return two_layer_loss(lambda q, h, _: L.engram_layer(q, h, table=T1, hashing=H1, pending=pend1),
                              lambda q, h, _: L.engram_layer(q, h, table=T2, hashing=H2, pending=pend2))(p, x, tok)

    reference = two_layer_loss(
        lambda q, h, t: L.engram_layer_reference(q, h, t, table_rows=rows1, sf_rows=sf1, num_ranks=R, hashing=H1),
        lambda q, h, t: L.engram_layer_reference(q, h, t, table_rows=rows2, sf_rows=sf2, num_ranks=R, hashing=H2))
    v, (gp, gx) = jax.jit(jax.value_and_grad(native, argnums=(0, 1)))(params_g, put(x_h), put(tok_h))
    rv, (rgp, rgx) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(params_h, x_h, tok_h)
    # Each wait is ordered after its layer's input (this rank's hidden [B/R, S, H]), under the gradient too.
    avals = wait_after_avals(jax.value_and_grad(native), params_g, put(x_h), put(tok_h))
    assert [(a.shape, a.dtype) for a in avals] == [((B // R, S, H), jnp.float32)] * 2, avals
    # The same math per token; only sums across tokens differ in order (the loss and the replicated parameters'
    # gradients are per-rank partial sums then a psum, against one global sum): float32 rounding.
    assert rel(v, rv) <= 1e-5, (float(v), float(rv))
    assert rel(gx, rgx) <= 1e-5, rel(gx, rgx)
    for k, g in jax.tree_util.tree_leaves_with_path(gp):
        r = rgp
        for part in k:
            r = r[part.key]
        assert rel(g, r) <= 1e-5 and float(np.abs(np.asarray(g)).max()) > 0, (jax.tree_util.keystr(k), rel(g, r))
    # The forward alone: every token's output row is computed by the same ops, bit for bit.
    fwd = jax.jit(lambda p, x, tok: L.engram_layer(p["e2"], x, table=T2, hashing=H2,
                                                   pending=L.engram_prefetch(T2, tok, hashing=H2)))
    out = fwd(params_g, put(x_h), put(tok_h))
    want = L.engram_layer_reference(p2, x_h, tok_h, table_rows=rows2, sf_rows=sf2, num_ranks=R, hashing=H2)
    assert rel(out, want) <= 1e-6, rel(out, want)


@check("modes_and_padding_through_prefetch")
def _():
    ids_h = rng.integers(-3, T2.total_entries + 5, (B, S, 3)).astype(np.int32)  # padding and out-of-range ids
    for mode in ("fill", "clip"):
        def body(ids):
            data, sf = T2.wait(L.engram_prefetch(T2, ids=ids, mode=mode))
            return data, sf

        data, sf = smap(body, P("ep"), (P("ep"), P("ep")))(put(ids_h))
        rd, rs = ref.engram_lookup(rows2.reshape(R, -1, D2), ids_h.reshape(B * S, 3), mode=mode, sf_table=sf2)
        assert np.array_equal(np.asarray(data).view(np.uint8), np.asarray(rd).view(np.uint8)), mode
        assert np.array_equal(np.asarray(sf), np.asarray(rs)), mode


@check("layers_inside_user_shard_map")
def _():
    want = jax.jit(lambda p, x, t: L.engram_layer(p, x, t, table=T1, hashing=H1))(params_g["e1"], put(x_h),
                                                                                put(tok_h))

    def body(p, x, t):
        a = L.engram_layer(p, x, table=T1, hashing=H1, pending=L.engram_prefetch(T1, t, hashing=H1))
        b = L.engram_layer(p, x, t, table=T1, hashing=H1)   # no second shard_map: the per-rank layer
        return a, b

    a, b = smap(body, (P(), P("ep"), P("ep")), (P("ep"), P("ep")))(params_g["e1"], put(x_h), put(tok_h))
    assert np.array_equal(np.asarray(a), np.asarray(want)) and np.array_equal(np.asarray(b), np.asarray(want))

    # A prefetch started outside the user's shard_map, passed in with the batch spec.
    @jax.jit
    def outer(p, x, t):
        pend = L.engram_prefetch(T1, t, hashing=H1)
        f = jax.shard_map(lambda p, x, pend: L.engram_local(p, x, table=T1, hashing=H1, pending=pend), mesh=mesh,
                          in_specs=(P(), P("ep"), L.batch_spec(ctx)), out_specs=P("ep"))
        return f(p, x, pend)

    assert np.array_equal(np.asarray(outer(params_g["e1"], put(x_h), put(tok_h))), np.asarray(want))


@check("nnx_two_memories_prefetch_value_and_grad")
def _():
    from flax import nnx

    from jax_engram.nn import EngramMemory

    class Model(nnx.Module):
        def __init__(self, prefetch: bool):
            self.prefetch = prefetch
            self.mem1 = EngramMemory(H, ctx=ctx, memory_dim=8, buckets_per_head=16, hashing=H1, rngs=nnx.Rngs(3))
            self.w = nnx.Param(put(w_mid, P()))
            self.mem2 = EngramMemory(H, ctx=ctx, memory_dim=4, buckets_per_head=16, hashing=H2, placement="device",
                                     rngs=nnx.Rngs(5))

        def __call__(self, x, tok):
            if self.prefetch:
                pend = [self.mem1.prefetch(tok)]                 # every Engram layer, at step start, in order
                pend.append(self.mem2.prefetch(tok, after=pend[0]))
                h = self.mem1(x, pending=pend[0])
                return self.mem2(jnp.tanh(h @ self.w[...]), pending=pend[1])
            h = self.mem1(x, tok)
            return self.mem2(jnp.tanh(h @ self.w[...]), tok)

    model = Model(prefetch=True)

    @nnx.jit
    def step(model, x, tok):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x, tok) ** 2))(model)

    x, tok = put(x_h), put(tok_h)
    loss, grads = step(model, x, tok)
    model.prefetch = False  # the same modules and tables, looked up at the layers
    loss0, grads0 = step(model, x, tok)
    # The same per-rank computations in one program; only where the reads are waited for differs.
    assert np.array_equal(np.asarray(loss), np.asarray(loss0)), (loss, loss0)
    g, g0 = nnx.state(grads, nnx.Param), nnx.state(grads0, nnx.Param)
    leaves, leaves0 = jax.tree_util.tree_leaves_with_path(g), jax.tree_util.tree_leaves(g0)
    assert len(leaves) == 5 and len(leaves0) == 5, leaves
    for (k, a), b in zip(leaves, leaves0):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and float(np.abs(np.asarray(a)).max()) > 0, \
            jax.tree_util.keystr(k)

    # Against the pure-JAX twin of each layer (rows read back from the tables).
    def rows(m):
        return np.asarray(m.table.lookup_global(np.arange(m.table.total_entries, dtype=np.int32)[:, None])[0])

    m1, m2 = model.mem1, model.mem2
    q1 = {"w_key": np.asarray(m1.w_key[...]), "w_value": np.asarray(m1.w_value[...])}
    q2 = {"w_key": np.asarray(m2.w_key[...]), "w_value": np.asarray(m2.w_value[...])}
    h = L.engram_layer_reference(q1, x_h, tok_h, table_rows=rows(m1), num_ranks=R, hashing=H1)
    h = jnp.tanh(h @ w_mid)
    want = L.engram_layer_reference(q2, h, tok_h, table_rows=rows(m2), num_ranks=R, hashing=H2)
    assert rel(loss, jnp.sum(want ** 2)) <= 1e-5, (float(loss), float(jnp.sum(want ** 2)))

    st = L.engram_decode_init(B, hashing=H1)
    ids_m, _ = m1.decode_ids(st, tok_h[:, 1])
    ids_f, _ = L.engram_decode_ids(st, tok_h[:, 1], hashing=H1, total_entries=m1.table.total_entries)
    assert np.array_equal(np.asarray(ids_m), np.asarray(ids_f))

    # The module inside a user's shard_map: prefetch and call on local shapes.
    gd, state = nnx.split(model.mem1)

    def body(state, x, t):
        mem = nnx.merge(gd, state)
        return mem(x, pending=mem.prefetch(t))

    out = smap(body, (P(), P("ep"), P("ep")), P("ep"))(state, x, tok)
    assert np.array_equal(np.asarray(out), np.asarray(jax.jit(lambda x, t: model.mem1(x, t))(x, tok)))


@check("decode_ids_match_full_sequence")
def _():
    h = L.EngramHashing(orders=(2, 3, 5), heads_per_order=2, seed=7)
    total = 4096
    seq = rng.integers(0, 2**31 - 1, (5, 11)).astype(np.int32)
    full = np.asarray(L.engram_ids(seq, hashing=h, total_entries=total))
    step = jax.jit(lambda s, t: L.engram_decode_ids(s, t, hashing=h, total_entries=total))
    state = L.engram_decode_init(5, hashing=h)
    assert state.history.shape == (5, 4) and state.length.shape == (5,)
    for t in range(seq.shape[1]):
        ids, state = step(state, seq[:, t])
        assert np.array_equal(np.asarray(ids), full[:, t]), t
    # After a prompt of a different length per sequence (right padding beyond it): the next ids are those of
    # the full sequence at each sequence's own position.
    lengths = np.array([0, 1, 3, 4, 7], np.int32)
    state = L.engram_decode_init(jnp.asarray(seq), hashing=h, lengths=jnp.asarray(lengths))
    for k in range(3):
        pos = lengths + k
        ids, state = step(state, seq[np.arange(5), pos])
        assert np.array_equal(np.asarray(ids), full[np.arange(5), pos]), k


@check("decode_prefetch_layer")
def _():
    # One decode step of the two-table model: ids from the carried state, prefetched, consumed at the layer; equal
    # to the full-sequence layer's row at that position.
    t = S - 1
    state = L.engram_decode_init(jnp.asarray(tok_h[:, :t]), hashing=H1)
    state = jax.tree.map(lambda a: put(np.asarray(a)), state)

    @jax.jit
    def decode(p, state, new_tok, x):
        ids, state = L.engram_decode_ids(state, new_tok, hashing=H1, total_entries=T1.total_entries)
        pend = L.engram_prefetch(T1, ids=ids[:, None], hashing=H1)
        return L.engram_layer(p, x, table=T1, hashing=H1, pending=pend), state

    out, state2 = decode(params_g["e1"], state, put(tok_h[:, t]), put(x_h[:, t:t + 1]))
    assert np.array_equal(np.asarray(state2.history[:, -1]), tok_h[:, t].astype(np.uint32))
    want = L.engram_layer_reference(p1, x_h, tok_h, table_rows=rows1, sf_rows=sf1, num_ranks=R, hashing=H1)
    assert out.shape == (B, 1, H) and rel(out[:, 0], want[:, t]) <= 1e-6, rel(out[:, 0], want[:, t])


@check("dequantize_semantics")
def _():
    data = rng.standard_normal((3, 2 * 8)).astype(np.float32)
    e = rng.integers(100, 150, (3, 2, 4)).astype(np.uint8)           # 1 int32 pack per row: 4 blocks of 2
    got = np.asarray(L.engram_dequantize(jnp.asarray(data), jnp.asarray(e.view(np.int32).reshape(3, 2)), table=T1))
    want = data.reshape(3, 2, 4, 2) * np.exp2(e.astype(np.float64) - 127).astype(np.float32)[..., None]
    assert np.array_equal(got, want.reshape(3, 16))
    s = rng.uniform(0.5, 2, (3, 2 * 2)).astype(np.float32)          # 2 float32 packs per row: 2 blocks of 4
    got = np.asarray(L.engram_dequantize(jnp.asarray(data), jnp.asarray(s), table=T2))
    assert np.array_equal(got, (data.reshape(3, 2, 2, 4) * s.reshape(3, 2, 2, 1)).reshape(3, 16))


@check("memory_dim_mismatch_raises")
def _():
    bad = {k: put(v, P()) for k, v in L.init_engram_params(jax.random.key(0), hidden=H, memory_dim=4,
                                                           num_heads=H1.num_heads).items()}
    raises(lambda: L.engram_layer(bad, put(x_h), put(tok_h), table=T1, hashing=H1), ValueError, "memory_dim 8")
    raises(lambda: smap(lambda p, x, t: L.engram_local(p, x, t, table=T1, hashing=H1), (P(), P("ep"), P("ep")),
                        P("ep"))(bad, put(x_h), put(tok_h)), ValueError, "memory_dim")
    raises(lambda: L.engram_layer_reference(jax.tree.map(np.asarray, bad), x_h, tok_h, table_rows=rows1,
                                            num_ranks=R, hashing=H1), ValueError, "memory_dim")


@check("misuse_errors")
def _():
    x, tok = put(x_h), put(tok_h)
    raises(lambda: L.engram_layer(params_g["e1"], x, table=T1, hashing=H1), TypeError, "exactly one")
    raises(lambda: L.engram_prefetch(T1, tok, ids=tok, hashing=H1), TypeError, "exactly one")
    raises(lambda: L.engram_prefetch(T1, tok, hashing=H1), RuntimeError, "not eagerly")

    z = jnp.zeros((0,), jnp.int32)
    raises(lambda: L.engram_layer(params_g["e1"], x, table=T1, hashing=H1,
                                  pending=je.EngramPending(z, z, z, z, False, False)), TypeError, "one rank's")
    # A pending of other positions than the layer's hidden.
    raises(lambda: jax.jit(lambda p, x, t: L.engram_layer(p, x[:, :3], table=T1, hashing=H1,
                                                          pending=L.engram_prefetch(T1, t, hashing=H1)))(
        params_g["e1"], x, tok), ValueError, "positions")


@check("hierarchical_context_prefetch_grad")
def _():
    # A (node, gpu) context (2 x 2 here): the same layer calls; its wait takes the ordering argument too.
    mesh2 = jax.make_mesh((2, R // 2), ("node", "gpu"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    ctx2 = je.init(mesh2, ("node", "gpu"), timeout_s=60.0)
    live = je.live_contexts()
    assert any(c is ctx2 for c in live) and not any(c is ctx2.inner for c in live), live  # what the user holds
    try:
        t = je.EngramTable(16, 8, jnp.float32, ctx=ctx2, placement="device")
        rows = rng.standard_normal((t.total_entries, 8)).astype(np.float32)
        jax.block_until_ready(t.write_global(rows))
        p = L.init_engram_params(jax.random.key(3), hidden=H, memory_dim=8, num_heads=H1.num_heads)
        pg = {k: L.put_global(v, ctx2, P()) for k, v in p.items()}
        bs = L.batch_spec(ctx2)

        def native(p, x, tk):
            pend = L.engram_prefetch(t, tk, hashing=H1)
            return jnp.sum(L.engram_layer(p, jnp.tanh(x), table=t, hashing=H1, pending=pend) ** 2)

        def reference(p, x, tk):
            return jnp.sum(L.engram_layer_reference(p, jnp.tanh(x), tk, table_rows=rows, num_ranks=R,
                                                    hashing=H1) ** 2)

        v, (gp, gx) = jax.jit(jax.value_and_grad(native, argnums=(0, 1)))(
            pg, L.put_global(x_h, ctx2, bs), L.put_global(tok_h, ctx2, bs))
        rv, (rgp, rgx) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(p, x_h, tok_h)
        assert rel(v, rv) <= 1e-5 and rel(gx, rgx) <= 1e-5, (rel(v, rv), rel(gx, rgx))  # summation order only
        for k in p:
            assert rel(gp[k], rgp[k]) <= 1e-5, (k, rel(gp[k], rgp[k]))
    finally:
        ctx2.close()
    assert not any(c is ctx2 or c is ctx2.inner for c in je.live_contexts())


@check("two_prefetched_layers_grad_inside_user_shard_map")
def _():
    # Both layers prefetched and consumed inside the user's own shard_map (local shapes), differentiated there: the
    # per-rank loss and gradients, summed over ranks, against the pure-JAX model.
    def body(p, x, t):
        def loss(p, x):
            pend1 = L.engram_prefetch(T1, t, hashing=H1)
            pend2 = L.engram_prefetch(T2, t, hashing=H2)
            x = L.start_before(x, pend1, pend2)
            return two_layer_loss(lambda q, h, _: L.engram_layer(q, h, table=T1, hashing=H1, pending=pend1),
                                  lambda q, h, _: L.engram_layer(q, h, table=T2, hashing=H2, pending=pend2))(p, x, t)

        v, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
        return jax.lax.psum(v, "ep"), gp, gx  # gp: the replicated parameters' gradients, summed over ranks by JAX

    v, gp, gx = smap(body, (P(), P("ep"), P("ep")), (P(), P(), P("ep")))(params_g, put(x_h), put(tok_h))
    reference = two_layer_loss(
        lambda q, h, t: L.engram_layer_reference(q, h, t, table_rows=rows1, sf_rows=sf1, num_ranks=R, hashing=H1),
        lambda q, h, t: L.engram_layer_reference(q, h, t, table_rows=rows2, sf_rows=sf2, num_ranks=R, hashing=H2))
    rv, (rgp, rgx) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(params_h, x_h, tok_h)
    assert rel(v, rv) <= 1e-5 and rel(gx, rgx) <= 1e-5, (rel(v, rv), rel(gx, rgx))  # summation order only
    for k, g in jax.tree_util.tree_leaves_with_path(gp):
        r = rgp
        for part in k:
            r = r[part.key]
        assert rel(g, r) <= 1e-5 and float(np.abs(np.asarray(g)).max()) > 0, (jax.tree_util.keystr(k), rel(g, r))


@check("decode_prefetch_in_scan")
def _():
    # A generation loop as lax.scan: every step derives its ids from the carried state, prefetches, and consumes
    # them at the layer; each step's output equals the full-sequence layer's row at that position. Global arrays,
    # then inside a user's shard_map (where a state made from the batch size is marked varying over the axis).
    want = L.engram_layer_reference(p1, x_h, tok_h, table_rows=rows1, sf_rows=sf1, num_ranks=R, hashing=H1)

    def generate(p, tok, x, state):
        def step(state, inp):
            t, xt = inp
            ids, state = L.engram_decode_ids(state, t, hashing=H1, total_entries=T1.total_entries)
            y = L.engram_layer(p, xt[:, None], table=T1, hashing=H1, pending=L.engram_prefetch(T1, ids=ids[:, None]))
            return state, y[:, 0]

        _, ys = jax.lax.scan(step, state, (tok.T, jnp.swapaxes(x, 0, 1)))
        return jnp.swapaxes(ys, 0, 1)

    state = jax.tree.map(lambda a: put(np.asarray(a)), L.engram_decode_init(B, hashing=H1))
    out = jax.jit(generate)(params_g["e1"], put(tok_h), put(x_h), state)
    assert out.shape == want.shape and rel(out, want) <= 1e-6, rel(out, want)

    def body(p, tok, x):
        state = jax.lax.pcast(L.engram_decode_init(tok.shape[0], hashing=H1), ("ep",), to="varying")
        return generate(p, tok, x, state)

    out = smap(body, (P(), P("ep"), P("ep")), P("ep"))(params_g["e1"], put(tok_h), put(x_h))
    assert rel(out, want) <= 1e-6, rel(out, want)


@check("checked_mode_through_prefetch")
def _():
    # mode="checked" through a prefetch: valid ids give fill's rows; an out-of-range id fails that call with the
    # op's message, once, and the table's next call works (nothing left behind).
    def body(ids):
        return T2.wait(L.engram_prefetch(T2, ids=ids, mode="checked"))

    f = smap(body, P("ep"), (P("ep"), P("ep")))
    good = rng.integers(-1, T2.total_entries, (B, S, 3)).astype(np.int32)
    data, sf = f(put(good))
    rd, rs = ref.engram_lookup(rows2.reshape(R, -1, D2), good.reshape(B * S, 3), mode="fill", sf_table=sf2)
    assert np.array_equal(np.asarray(data).view(np.uint8), np.asarray(rd).view(np.uint8))
    assert np.array_equal(np.asarray(sf), np.asarray(rs))
    bad = good.copy()
    bad[B - 1, 2, 1] = T2.total_entries + 7
    raises(lambda: jax.block_until_ready(f(put(bad))), Exception, f"id {T2.total_entries + 7}")
    data, _ = f(put(good))
    assert np.array_equal(np.asarray(data).view(np.uint8), np.asarray(rd).view(np.uint8))
    ctx.check()


@check("captured_token_ids_in_jit")
def _():
    # Token ids that the jitted step captures (a concrete array, not an argument) are staged like any other.
    tok = put(tok_h)
    out = jax.jit(lambda p, x: L.engram_layer(p, x, table=T1, hashing=H1,
                                              pending=L.engram_prefetch(T1, tok, hashing=H1)))(params_g["e1"],
                                                                                               put(x_h))
    want = jax.jit(lambda p, x, t: L.engram_layer(p, x, t, table=T1, hashing=H1))(params_g["e1"], put(x_h), tok)
    assert np.array_equal(np.asarray(out), np.asarray(want))


@check("quantize_roundtrip")
def _():
    # engram_quantize against engram_dequantize: every block's largest element lands at [224, 448] of the FP8 range
    # (exactly 448 with float32 scales), every element within FP8's half step of its value (normals), UE8M0 scales
    # are powers of two, an all-zero row stays zero with the scale 1.
    x = (rng.standard_normal((64, 8)) * np.exp2(rng.integers(-30, 30, (64, 1)))).astype(np.float32)
    x[5] = 0
    for packs, sdt in ((1, np.float32), (2, np.float32), (1, np.int32), (2, np.int32)):
        q, sf = L.engram_quantize(x, num_sf_packs=packs, sf_dtype=sdt)
        assert q.dtype == jnp.float8_e4m3fn and sf.shape == (64, packs) and sf.dtype == sdt
        blocks = 4 * packs if sdt == np.int32 else packs
        if sdt == np.int32:
            e = np.asarray(sf).view(np.uint8).reshape(64, blocks).astype(np.int64)
            scale = np.exp2(e - 127.0)
        else:
            scale = np.asarray(sf, np.float64)
        qb = np.abs(np.asarray(q, np.float64)).reshape(64, blocks, -1)
        xb = np.abs(x.astype(np.float64)).reshape(64, blocks, -1)
        amax_q = qb.max(-1)
        nz = xb.max(-1) > 0
        assert np.all(amax_q[nz] <= 448) and np.all(amax_q[nz] >= (224 if sdt == np.int32 else 448)), (packs, sdt)
        assert np.all(scale[~nz] == 1) and np.all(qb[~nz] == 0)
        y = np.asarray(L.engram_dequantize(q, sf, table=T2 if sdt == np.float32 else T1),  # tables of width 8
                       np.float64).reshape(64, blocks, -1)
        normal = xb >= scale[..., None] * 2.0 ** -6
        err = np.abs(np.abs(y) - xb)
        assert np.all(err[normal] <= xb[normal] * 2.0 ** -4 * (1 + 1e-6)), (packs, sdt, float(err[normal].max()))


@check("nnx_fp8_memory_prefetch")
def _():
    # An FP8 EngramMemory (float32 scales, then packed UE8M0 ones): the module quantizes the rows it writes; the
    # prefetched layer equals the layer looked up in place, bit for bit, and the pure-JAX layer on the rows and
    # scales read back from the table.
    from flax import nnx

    from jax_engram.nn import EngramMemory

    for packs, sdt in ((None, np.float32), (2, np.int32)):
        mem = EngramMemory(H, ctx=ctx, memory_dim=8, buckets_per_head=16, hashing=H1, rngs=nnx.Rngs(9),
                           table_dtype=jnp.float8_e4m3fn, num_sf_packs=packs, sf_dtype=sdt)
        t = mem.table
        assert t.num_sf_packs == (packs or 1) and t.dtype == np.dtype(jnp.float8_e4m3fn)
        x, tok = put(x_h), put(tok_h)
        a = nnx.jit(lambda m, x, tok: m(x, pending=m.prefetch(tok)))(mem, x, tok)
        b = nnx.jit(lambda m, x, tok: m(x, tok))(mem, x, tok)
        assert np.array_equal(np.asarray(a), np.asarray(b)), (packs, sdt)
        rows, sf = t.lookup_global(np.arange(t.total_entries, dtype=np.int32)[:, None])
        q = {"w_key": np.asarray(mem.w_key[...]), "w_value": np.asarray(mem.w_value[...])}
        want = L.engram_layer_reference(q, x_h, tok_h, table_rows=np.asarray(rows), sf_rows=np.asarray(sf),
                                        num_ranks=R, hashing=H1)
        assert rel(a, want) <= 1e-6, (packs, sdt, rel(a, want))
    raises(lambda: mem.write_table(np.zeros((4, 8), jnp.float8_e4m3fn)), ValueError, "scale factors")


def _depends(jaxpr, var, targets) -> bool:
    """Whether ``var`` of ``jaxpr`` is computed from any of ``targets`` (a backward walk over its equations)."""
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    todo, seen = [var], set()
    while todo:
        v = todo.pop()
        if v in targets:
            return True
        if v in seen or v not in producer:
            continue
        seen.add(v)
        todo.extend(x for x in producer[v].invars if isinstance(x, jax.extend.core.Var))
    return False


@check("prefetch_after_orders_the_fetches")
def _():
    # after= another prefetch: the second layer's fetch is issued after the first's (a data dependence XLA must
    # keep), in a global program (the second prefetch takes the first's status) and inside a user's shard_map (the
    # second fetch's ordering operand comes from the first fetch's status); the rows are unchanged.
    def native(p, x, tok):
        pend1 = L.engram_prefetch(T1, tok, hashing=H1)
        pend2 = L.engram_prefetch(T2, tok, hashing=H2, after=pend1)
        return two_layer_loss(lambda q, h, _: L.engram_layer(q, h, table=T1, hashing=H1, pending=pend1),
                              lambda q, h, _: L.engram_layer(q, h, table=T2, hashing=H2, pending=pend2))(p, x, tok)

    unordered = two_layer_loss(lambda q, h, t: L.engram_layer(q, h, t, table=T1, hashing=H1),
                               lambda q, h, t: L.engram_layer(q, h, t, table=T2, hashing=H2))
    args = (params_g, put(x_h), put(tok_h))
    assert np.array_equal(np.asarray(jax.jit(native)(*args)), np.asarray(jax.jit(unordered)(*args)))
    top = jax.make_jaxpr(native)(*args).jaxpr
    prefetches = [e for e in top.eqns if e.primitive.name in ("pjit", "jit")
                  and "jax_engram_engram_fetch" in str(e.params.get("jaxpr"))]
    assert len(prefetches) == 2, [e.primitive.name for e in top.eqns]
    assert set(prefetches[0].outvars) & set(prefetches[1].invars), "the second prefetch does not take the first's"

    def body(x, t):
        pend1 = L.engram_prefetch(T1, t, hashing=H1)
        pend2 = L.engram_prefetch(T2, t, hashing=H2, after=pend1)
        return T1.wait(pend1, after=x)[0], T2.wait(pend2, after=x)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"), P("ep")))
    inner = [e for e in jax.make_jaxpr(f)(put(x_h), put(tok_h)).jaxpr.eqns if e.primitive.name == "shard_map"]
    inner = inner[0].params["jaxpr"]
    fetches = [e for e in inner.eqns if e.primitive.name == "jax_engram_ffi_call"
               and e.params["target"] == "jax_engram_engram_fetch"]
    assert len(fetches) == 2
    assert _depends(inner, fetches[1].invars[-1], set(fetches[0].outvars)), "fetch 2 is not ordered after fetch 1"
    assert not _depends(inner, fetches[0].invars[-1], set(fetches[1].outvars))
    a, b = jax.jit(f)(put(x_h), put(tok_h))
    want = jax.jit(jax.shard_map(lambda t: (T1.lookup(L.engram_ids(t, hashing=H1, total_entries=T1.total_entries)
                                                      .reshape(-1, H1.num_heads))[0],
                                            T2.lookup(L.engram_ids(t, hashing=H2, total_entries=T2.total_entries)
                                                      .reshape(-1, H2.num_heads))[0]),
                                 mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"), P("ep"))))(put(tok_h))
    assert all(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(w).view(np.uint8))
               for u, w in zip((a, b), want))
    raises(lambda: jax.jit(lambda t: L.engram_prefetch(T2, t, hashing=H2, after=jnp.zeros(())))(put(tok_h)),
           ValueError, "takes another prefetch")


print("RESULT " + json.dumps({"checks": checks.results, "devices": R}), flush=True)
ctx.close()
sys.exit(0 if all(checks.results.values()) else 1)
