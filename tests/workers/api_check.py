"""The public API's shape: spellings, deprecations, result types, ordering (after= in, done out), type hints, the
layers and the Flax NNX modules. One process, CPU devices (--cpu-devices, default 2).

Prints `CHECK <name> PASS|FAIL <detail>` lines and one `RESULT <json>` line ({"checks": {name: bool}}).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import typing
import warnings

from _harness import Checks

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-devices", type=int, default=2)
ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
ap.add_argument("--timeout", type=float, default=60.0)
args = ap.parse_args()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", args.cpu_devices)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import layers as L  # noqa: E402

R = args.cpu_devices
mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
ctx = je.init(mesh, "ep", timeout_s=args.timeout)
checks = Checks(select=lambda name: not args.only or name in args.only.split(","))
check = checks.case


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def put(a, spec=P("ep")):
    return L.put_global(np.asarray(a), ctx, spec)


def warns(fn, needle):
    """fn() must emit a DeprecationWarning containing needle; returns fn's result."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    msgs = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)]
    assert any(needle in m for m in msgs), f"no DeprecationWarning with {needle!r}; got {msgs}"
    return out


def silent(fn):
    """fn() must emit no DeprecationWarning from jax_engram."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    bad = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning) and "jax_engram" in str(x.message)]
    assert not bad, f"unexpected deprecation warnings: {bad}"
    return out


M, H, K, E = 8, 16, 2, 2 * R
rng = np.random.default_rng(0)
x_h = rng.standard_normal((R, M, H)).astype(jnp.bfloat16)
idx_h = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(R)]).astype(np.int32)
kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M)


@check("barrier_and_ring_exchange_keyword_ctx")
def _():
    def body(a):
        t = je.barrier(ctx=ctx)
        t2 = je.barrier(ctx=ctx, after=t)
        y = je.ring_exchange(a[0], ctx=ctx, placement="host")
        return y[None], t2.reshape(1)
    y, t = silent(lambda: smap(body, P("ep"), (P("ep"), P("ep")))(put(np.arange(R * 4, dtype=np.float32).reshape(R, 4))))
    assert t.dtype == jnp.float32, t.dtype
    want = np.roll(np.arange(R * 4, dtype=np.float32).reshape(R, 4), 1, axis=0)
    assert np.array_equal(np.asarray(y), want), (np.asarray(y), want)


@check("positional_ctx_is_refused")
def _():
    for call in (lambda: je.barrier(ctx), lambda: je.ring_exchange(np.ones(4, np.float32), ctx),
                 lambda: je.EngramTable(ctx, 4, 8, jnp.float32)):
        try:
            call()
        except TypeError:
            continue
        raise AssertionError("a positional context was accepted")


@check("combine_result_and_done")
def _():
    def body(x, i):
        d = je.dispatch(x[0], i[0], jnp.ones((M, K), jnp.float32), **kw)
        c = je.combine(d.recv_x, d.handle, topk_weights=d.recv_topk_weights)
        assert isinstance(c, je.CombineResult), type(c)
        assert isinstance(d, je.DispatchResult) and isinstance(d.handle, je.EPHandle)
        for done in (d.done, d.handle.done, c.done):
            assert done.dtype == jnp.float32 and done.shape == (), (done.dtype, done.shape)
        c2 = je.combine(d.recv_x, d.handle, after=c.done)  # no weights: same structure, None in their place
        assert isinstance(c2, je.CombineResult) and c2.combined_topk_weights is None
        return c.combined_x[None], c.combined_topk_weights[None]
    cx, cw = silent(lambda: smap(body, (P("ep"), P("ep")), (P("ep"), P("ep")))(put(x_h), put(idx_h)))
    # combine(dispatch(x)) = x * (ranks the token was sent to); exact in bf16 for at most 2 equal terms
    ranks = np.array([[len(set((idx_h[r, t] // (E // R)).tolist())) for t in range(M)] for r in range(R)])
    assert np.array_equal(np.asarray(cx, np.float32), ranks[..., None] * x_h.astype(np.float32))
    assert np.array_equal(np.asarray(cw), np.ones((R, M, K), np.float32))


@check("removed_ep_arguments_are_refused")
def _():
    def body(x, i):
        d = je.dispatch(x[0], i[0], **kw)
        res = je.combine(d.recv_x, d.handle)
        try:
            iter(res)
        except TypeError:
            pass
        else:
            raise AssertionError("a CombineResult must not unpack as a tuple (read .combined_x)")
        return res.combined_x[None]
    smap(body, (P("ep"), P("ep")), P("ep"))(put(x_h), put(idx_h))
    for fn, kwarg in ((je.dispatch, "deterministic"), (je.combine, "return_token")):
        assert kwarg not in inspect.signature(fn).parameters, (fn, kwarg)


@check("ordering_is_after_in_done_out")
def _():
    # Every public op that can be ordered after another takes it as the keyword-only after= (as wait does), and
    # what orders a later op is a result's done; the old spelling token is gone from both.
    ops = [je.barrier, je.dispatch, je.combine, je.EngramTable.write, je.EngramTable.fetch, je.EngramTable.lookup,
           je.EngramTable.wait, je.engram_prefetch, L.engram_local, L.moe_local]
    for f in ops:
        ps = inspect.signature(f).parameters
        assert "token" not in ps, f"{f.__qualname__} still takes token="
        assert "after" in ps, f"{f.__qualname__} takes no after="
        assert ps["after"].kind is inspect.Parameter.KEYWORD_ONLY and ps["after"].default is None, f.__qualname__
    for cls in (je.DispatchResult, je.CombineResult, je.EPHandle):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "done" in names and "token" not in names, (cls.__name__, sorted(names))
    t = je.EngramTable(4, 8, jnp.float32, ctx=ctx)

    def body(x, i):
        d = je.dispatch(x[0], i[0], **kw)
        for call in (lambda: je.dispatch(x[0], i[0], token=d.done, **kw),
                     lambda: je.combine(d.recv_x, d.handle, token=d.done),
                     lambda: je.barrier(ctx=ctx, token=d.done),
                     lambda: t.write(jnp.zeros((4, 8), jnp.float32), token=d.done),
                     lambda: t.fetch(jnp.zeros((2, 1), jnp.int32), d.done)):  # after= is keyword-only
            try:
                call()
            except TypeError:
                continue
            raise AssertionError("an ordering input was accepted without after=")
        done = t.write(jnp.zeros((4, 8), jnp.float32), after=d.done)
        data, _ = t.lookup(jnp.zeros((2, 1), jnp.int32) + 0 * i[0][:2, :1], after=done)
        c = je.combine(d.recv_x, d.handle, after=je.barrier(ctx=ctx, after=data[0, 0]))
        return c.combined_x[None]
    jax.block_until_ready(smap(body, (P("ep"), P("ep")), P("ep"))(put(x_h), put(idx_h)))
    t.free()


@check("results_are_frozen_pytrees")
def _():
    seen = {}
    t = je.EngramTable(4, 8, jnp.float32, ctx=ctx)

    def body(x, i):
        d = je.dispatch(x[0], i[0], **kw)
        c = je.combine(d.recv_x, d.handle)
        pend = t.fetch(jnp.zeros((2, 1), jnp.int32) + 0 * i[0][:2, :1])  # varying along "ep", like real ids
        for obj in (d, d.handle, c, pend):
            assert dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen, type(obj)
            f = dataclasses.fields(obj)[0].name
            try:
                setattr(obj, f, None)
            except dataclasses.FrozenInstanceError:
                pass
            else:
                raise AssertionError(f"{type(obj).__name__}.{f} is assignable")
            leaves, tree = jax.tree_util.tree_flatten(obj)
            back = jax.tree_util.tree_unflatten(tree, leaves)
            assert type(back) is type(obj)
            seen[type(obj).__name__] = len(leaves)
        h2 = d.handle.replace(done=d.done + 1)
        assert h2.config is d.handle.config and h2 is not d.handle
        data, _ = t.wait(pend)
        return c.combined_x[None] + 0 * data.sum()
    smap(body, (P("ep"), P("ep")), P("ep"))(put(x_h), put(idx_h))
    assert set(seen) == {"DispatchResult", "EPHandle", "CombineResult", "EngramPending"}, seen
    assert seen["EPHandle"] == 10, seen  # every array field is a leaf (non-expand: recv_topk_idx too)


@check("public_functions_are_typed")
def _():
    import jax_engram.nn as nn

    fns = [je.barrier, je.ring_exchange, je.dispatch, je.combine, je.init, je.moe_layer, je.engram_layer,
           je.EngramTable.__init__, je.EngramTable.write, je.EngramTable.fetch, je.EngramTable.wait,
           je.EngramTable.lookup, je.EngramTable.write_global, je.EngramTable.lookup_global, L.engram_ids,
           L.engram_local, L.moe_local, L.route, L.moe_experts, L.moe_layer_reference, L.engram_layer_reference,
           nn.EngramMemory.__init__, nn.MoE.__init__, nn.EngramMemory.__call__, nn.MoE.__call__,
           je.engram_prefetch, L.engram_dequantize, L.engram_decode_init, L.engram_decode_ids,
           nn.EngramMemory.prefetch, nn.EngramMemory.decode_ids]
    missing = []
    for f in fns:
        sig = inspect.signature(f)
        hints = typing.get_type_hints(f)
        for name, prm in sig.parameters.items():
            if name == "self" or name.startswith("_") or prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
                continue
            if name not in hints:
                missing.append(f"{f.__qualname__}({name})")
        if "return" not in hints and f.__name__ != "__init__":
            missing.append(f"{f.__qualname__} -> ?")
        assert f.__doc__ or f.__name__ in ("__call__", "__init__"), f"{f.__qualname__} has no docstring"
    assert not missing, f"parameters without type hints: {missing}"
    assert typing.get_type_hints(je.ring_exchange)["placement"] == typing.Literal["device", "host"]
    assert typing.get_type_hints(je.dispatch)["x"] is jax.Array
    assert os.path.exists(os.path.join(os.path.dirname(je.__file__), "py.typed"))


@check("moe_layer_matches_reference_bf16_and_grads")
def _():
    hidden, ffn = 16, 32
    p_h = jax.tree.map(np.asarray, L.init_moe_params(jax.random.key(3), hidden=hidden, ffn=ffn, num_experts=E))
    specs = L.moe_param_specs(p_h, ctx)
    gp = {k: put(v, specs[k]) for k, v in p_h.items()}
    assert gp["w_up"].sharding.spec[0] == "ep" and all(a is None for a in gp["router"].sharding.spec)
    x = rng.standard_normal((R * 2, 4, hidden)).astype(np.float32).astype(jnp.bfloat16)
    ct = rng.standard_normal(x.shape).astype(np.float32).astype(jnp.bfloat16)
    out, vjp = jax.vjp(lambda p, x: je.moe_layer(p, x, ctx=ctx, top_k=K), gp, put(x))
    gpo, gx = vjp(put(ct))
    r_out, r_vjp = jax.vjp(lambda p, x: L.moe_layer_reference(p, x, num_ranks=R, top_k=K), p_h, x)
    r_p, r_x = r_vjp(ct)

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
    assert rel(out, r_out) <= 1e-2, rel(out, r_out)
    assert rel(gx, r_x) <= 3e-2, rel(gx, r_x)
    for k in p_h:
        assert rel(gpo[k], r_p[k]) <= 3e-2, (k, rel(gpo[k], r_p[k]))
        assert float(np.abs(np.asarray(gpo[k], np.float32)).max()) > 0, k
    assert gpo["w_up"].sharding.spec[0] == "ep", gpo["w_up"].sharding


@check("nn_modules_grads_and_sharding")
def _():
    from flax import nnx

    from jax_engram.nn import EngramMemory, MoE

    hidden = 16
    for placement in ("host", "device"):
        mem = EngramMemory(hidden, ctx=ctx, memory_dim=8, buckets_per_head=64, placement=placement,
                           hashing=je.EngramHashing(orders=(2, 3), heads_per_order=2), rngs=nnx.Rngs(0))
        assert mem.table.placement == placement and mem.table.total_entries >= 64 * 4
    moe = MoE(hidden, 32, 2 * R, 2, ctx=ctx, rngs=nnx.Rngs(1))
    assert moe.w_up.value.sharding.spec[0] == "ep" and moe.w_up.value.shape == (2 * R, hidden, 32)
    assert all(a is None for a in moe.router.value.sharding.spec)
    x = put(rng.standard_normal((R * 2, 6, hidden)).astype(np.float32))
    ids = put(rng.integers(0, 100, (R * 2, 6)).astype(np.int32))

    class Block(nnx.Module):
        def __init__(self):
            self.mem, self.moe = mem, moe

        def __call__(self, x, ids):
            h = self.mem(x, ids)
            return h + self.moe(h)

    block = Block()

    @nnx.jit
    def loss_and_grads(block, x, ids):
        return nnx.value_and_grad(lambda b: jnp.sum(b(x, ids) ** 2))(block)

    loss, grads = loss_and_grads(block, x, ids)
    flat = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    names = {jax.tree_util.keystr(k) for k, _ in flat}
    for want in ("mem", "moe"):
        assert any(want in n for n in names), (want, names)
    for k, g in flat:
        assert np.all(np.isfinite(np.asarray(g))) and float(np.abs(np.asarray(g)).max()) > 0, jax.tree_util.keystr(k)
    # The module is the functional layer on its parameters.
    h_mod = block.mem(x, ids)
    h_fun = je.engram_layer({"w_key": mem.w_key.value, "w_value": mem.w_value.value}, x, ids, table=mem.table,
                            hashing=mem.hashing)
    assert np.array_equal(np.asarray(h_mod), np.asarray(h_fun))
    y_mod = moe(h_mod)
    y_fun = je.moe_layer({"router": moe.router.value, "w_up": moe.w_up.value, "w_down": moe.w_down.value}, h_fun,
                         ctx=ctx, top_k=2)
    assert np.array_equal(np.asarray(y_mod), np.asarray(y_fun))


@check("engram_ids_hashing")
def _():
    h = je.EngramHashing(orders=(2, 3), heads_per_order=3)
    toks = np.array([[5, 6, 7, 8, 5, 6, 7]], np.int32)
    ids = np.asarray(L.engram_ids(toks, hashing=h, total_entries=6000))
    assert ids.shape == (1, 7, 6) and ids.dtype == np.int32
    assert (ids[0, 0] == -1).all() and (ids[0, 1, :3] >= 0).all() and (ids[0, 1, 3:] == -1).all()
    assert (ids[0, 2:] >= 0).all() and (ids < 6000).all()
    # the same n-gram -> the same ids (bigram (5,6) at 1 and 5; trigram (5,6,7) at 2 and 6)
    assert np.array_equal(ids[0, 1, :3], ids[0, 5, :3]) and np.array_equal(ids[0, 2], ids[0, 6])
    # head j of the flattened ids lives at global id % num_heads == j (interleaved heads)
    assert ((ids[0, 2:] % 6) == np.arange(6)).all()
    assert len(set(ids[0, 2:, 0].tolist())) > 1  # different bigrams hash apart



@check("layers_on_a_dp_x_ep_mesh")
def _():
    # EP groups along "ep", data-parallel replicas along "dp": the layers shard the batch over (dp, ep) and
    # take gradients through dispatch/combine with operands varying along both axes.
    dp = 2 if R % 2 == 0 else 1
    m2 = jax.make_mesh((dp, R // dp), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with je.init(m2, "ep", timeout_s=args.timeout) as c2:
        nr = R // dp
        p_h = jax.tree.map(np.asarray, L.init_moe_params(jax.random.key(5), hidden=16, ffn=32, num_experts=2 * nr))
        gp = {k: L.put_global(v, c2, s) for (k, v), s in zip(p_h.items(), L.moe_param_specs(p_h, c2).values())}
        assert L.batch_spec(c2) == P(("dp", "ep"))
        x_h = rng.standard_normal((2 * R, 3, 16)).astype(np.float32)
        out, vjp = jax.vjp(lambda p, x: je.moe_layer(p, x, ctx=c2, top_k=2), gp, L.put_global(x_h, c2, L.batch_spec(c2)))
        g_p, g_x = vjp(out)
        n = 2 * nr  # sequences per EP group

        def ref(p, x):
            return jnp.concatenate([L.moe_layer_reference(p, x[i * n:(i + 1) * n], num_ranks=nr, top_k=2)
                                    for i in range(dp)])
        r_out, r_vjp = jax.vjp(ref, p_h, x_h)
        r_p, r_x = r_vjp(r_out)
        for name, a_, b_ in [("out", out, r_out), ("dx", g_x, r_x)] + [(k, g_p[k], r_p[k]) for k in p_h]:
            err = float(np.abs(np.asarray(a_) - np.asarray(b_)).max() / max(np.abs(np.asarray(b_)).max(), 1e-12))
            assert err <= 1e-4, (name, err)


ctx.close()
print("RESULT " + json.dumps({"checks": checks.results, "devices": R}), flush=True)
sys.exit(0 if all(checks.results.values()) else 1)
