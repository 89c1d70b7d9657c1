"""EPConfig as custom-call attributes, the jit cache over token counts, interleaved dispatch sequences, and calls
after close."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_engram as je
from jax_engram import ep

from _ep_check.common import EPC, LOCAL, R, SPEC, args, check, devices, local, mesh, same, shard
from _harness import expect_error


def suite_config(ctx):
    check("ep_config_attributes_and_cache_key", lambda: _config_check(ctx))
    check("ep_config_type_errors", _config_type_check)
    if not LOCAL:  # the local path calls no dispatch handler to check the tuning attributes
        check("ep_config_handler_safety_net", _config_safety_net_check)


def _config_check(ctx):
    """An EPConfig reaches the handlers as attributes of the custom calls (the per-op config over the context's), so
    a new config compiles anew; the results do not change. The dispatch's config also rules its combine. On the
    one-rank local path no handler takes the tuning: its guards are the only custom calls."""
    E, K, M, H = 4 * R, 2, 8, 128

    def make(config):
        def body(x, idx):
            d = ep.dispatch(x[0], idx[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M, config=config)
            y = ep.combine(d.recv_x, d.handle).combined_x
            return y[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))

    rng = np.random.default_rng(3)
    x = shard(rng.standard_normal((R, M, H)).astype(jnp.bfloat16))
    idx = shard(np.stack([rng.permutation(E)[:K] for _ in range(R * M)]).reshape(R, M, K).astype(np.int32))
    cfg = je.EPConfig(dispatch_copy_engine="never", dispatch_stage_warps=5, combine_stage_warps=11,
                      one_rank=EPC.one_rank)
    f_default, f_cfg = make(None), make(cfg)
    hlo = f_cfg.lower(x, idx).as_text()
    wants = ("jax_engram_ep_guard",) if LOCAL else ("stage_warps = 5", "stage_warps = 11", "copy_pieces = 0")
    for want in wants:
        if want not in hlo:
            return False, f"{want!r} not among the custom calls' attributes"
    if LOCAL and "jax_engram_ep_dispatch" in hlo:
        return False, "the one-rank local path calls the dispatch kernels"
    if not LOCAL and "stage_warps = 0" not in f_default.lower(x, idx).as_text():
        return False, "the default config does not pass stage_warps = 0"
    a, b = local(f_default(x, idx)), local(f_cfg(x, idx))
    same = sorted(a) == sorted(b) and all(np.array_equal(a[r].view(np.uint16), b[r].view(np.uint16)) for r in a)
    path = ctx.dispatch_path(max_tokens_per_rank=M, hidden_bytes=H * 2, topk=K, num_experts=E, config=cfg)
    want_path = "local (one rank)" if LOCAL else "pull (CPU)" if ctx.platform == "cpu" else "SM stores"
    return same and path == want_path, f"path={path}, same results: {same}"


def _config_safety_net_check():
    """The handlers check the tuning attributes again (a safety net behind Python's validation): a dispatch asking
    for copy-engine rows on CPU, or for more push warps than a CTA has on CUDA, fails naming the attribute."""
    from jax_engram import _call

    E, K, M, H = 4 * R, 2, 8, 128
    real = _call.call
    cpu = devices[0].platform == "cpu"
    bad, needle = (("copy_pieces", 3), "no copy-engine path") if cpu else (("stage_warps", 16), "stage_warps=16")

    def patched(ctx_, tgt, results, *ops, **attrs):
        if tgt.startswith("jax_engram_ep_dispatch"):
            attrs[bad[0]] = bad[1]
        return real(ctx_, tgt, results, *ops, **attrs)

    c = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)

    def body(x, i):
        return ep.dispatch(x[0], i[0], ctx=c, num_experts=E, max_tokens_per_rank=M).recv_x[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    x = np.ones((R, M, H), jnp.bfloat16)
    idx = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
    _call.call = patched
    try:
        return expect_error(lambda: jax.block_until_ready(f(shard(x), shard(idx))), needle)
    finally:
        _call.call = real
        c.close()


def _config_type_check():
    ok1, m1 = expect_error(lambda: je.init(mesh, "ep", ep_config={"copy_engine_pieces": 3}),
                           "ep_config must be a jax_engram.EPConfig")
    return ok1, m1


def suite_cache(ctx):
    check("jit_cache_hit_when_token_count_changes", lambda: _cache_check(ctx))


def _cache_check(ctx):
    """The real token count is data: changing which rows are masked must not retrace / recompile."""
    E, K, M, H = 4 * R, 2, 16, 128
    traces = []

    def body(x, idx):
        traces.append(1)
        d = ep.dispatch(x[0], idx[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=True,
                        expert_alignment=8, zero_padding=True)
        cx = ep.combine(d.recv_x, d.handle).combined_x
        return d.num_recv_tokens[None], cx[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((R, M, H)).astype(jnp.bfloat16)
    counts = []
    for frac in (0.0, 0.5, 0.9):
        idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(R)]).astype(np.int32)
        idx[rng.random(idx.shape) < frac] = -1
        n, cx = f(shard(x), shard(idx))
        counts.append(sorted(int(v) for v in local(n).values()))
        # combine(dispatch(x)) = x * (number of routed (token, k)); with K = 2 every partial sum is exact
        for r, got in local(cx).items():
            nk = (idx[r] >= 0).sum(-1)
            want = np.where(nk[:, None] > 0, x[r].astype(np.float32) * nk[:, None], 0.0).astype(jnp.bfloat16)
            if not same(got, want):
                return False, f"combine(dispatch(x)) wrong on rank {r} (mask fraction {frac})"
    ok = len(traces) == 1 and f._cache_size() == 1 and len({tuple(c) for c in counts}) > 1
    return ok, f"traces={len(traces)} cache={f._cache_size()} counts={counts}"


def suite_sequences(ctx):
    check("sequences_interleaved", lambda: _sequences_check(ctx))
    check("call_after_close_fails_cleanly", _after_close_check)


def _after_close_check():
    """A compiled function of a closed context must fail with an error, not run: with cuda_graphs a replayed graph
    would launch kernels into the freed windows, so close() drops JAX's compiled executables and the call retraces."""
    c2 = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout, cuda_graphs=args.cuda_graphs)
    E, M, H = 4 * R, 8, 128

    def body(x, i):
        d = ep.dispatch(x[0], i[0], ctx=c2, num_experts=E, max_tokens_per_rank=M)
        y = ep.combine(d.recv_x, d.handle).combined_x
        return y[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    xs = shard(np.ones((R, M, H), jnp.bfloat16))
    ids = shard(np.tile(np.array([[0, 1]], np.int32), (R, M, 1)))
    try:
        jax.block_until_ready(f(xs, ids))
        c2.check()
    finally:
        c2.close()
    return expect_error(lambda: jax.block_until_ready(f(xs, ids)), "closed")


def _sequences_check(ctx):
    """Two configs interleaved in one jitted loop: a large one (on 2 GPUs the auto policy moves its rows with the
    copy engine: the stream sequence, host-counted) and a small one (SM stores: with cuda_graphs, the graph targets
    and the graph sequence, replayed without the handler). Each sequence must stay whole whatever the other does
    (ep_layout.h, EpSequence). Checked: combine(dispatch(x)) and combine(cached dispatch(x2)) against numpy, every iteration's
    result kept."""
    rng = np.random.default_rng(11)
    cfgs = {"big": dict(M=320, H=7168, E=32 * R, K=8), "small": dict(M=16, H=128, E=4 * R, K=4)}
    data = {}
    for name, c in cfgs.items():
        idx = np.stack([np.stack([rng.permutation(c["E"])[:c["K"]] for _ in range(c["M"])]) for _ in range(R)])
        idx = idx.astype(np.int32)
        idx[rng.random(idx.shape) < 0.1] = -1
        x = rng.standard_normal((R, c["M"], c["H"])).astype(jnp.bfloat16)
        data[name] = (x, idx)
    iters = 3

    def body(xb, ib, xs, i_s):
        xb, ib, xs, i_s = xb[0], ib[0], xs[0], i_s[0]
        kb = dict(ctx=ctx, num_experts=cfgs["big"]["E"], max_tokens_per_rank=cfgs["big"]["M"])
        ks = dict(ctx=ctx, num_experts=cfgs["small"]["E"], max_tokens_per_rank=cfgs["small"]["M"])

        def step(i, carry):
            tok, ob, os1, os2 = carry
            db = ep.dispatch(xb, ib, after=tok, **kb)
            ds = ep.dispatch(xs, i_s, after=db.done, **ks)
            dc = ep.dispatch(xs * 2, handle=ds.handle, after=ds.done, **ks)
            rb = ep.combine(db.recv_x, db.handle, after=dc.done)
            r1 = ep.combine(ds.recv_x, ds.handle, after=rb.done)
            r2 = ep.combine(dc.recv_x, ds.handle, after=r1.done)
            cb, c1, c2, tok = rb.combined_x, r1.combined_x, r2.combined_x, r2.done
            return tok, ob.at[i].set(cb), os1.at[i].set(c1), os2.at[i].set(c2)

        def z(shape, dtype):  # varying along "ep", like the ops' outputs
            return jax.lax.pcast(jnp.zeros(shape, dtype), "ep", to="varying")
        tok0 = z((), jnp.float32)
        _, ob, os1, os2 = jax.lax.fori_loop(0, iters, step, (tok0, z((iters,) + xb.shape, xb.dtype), z((iters,) + xs.shape, xs.dtype),
                                                            z((iters,) + xs.shape, xs.dtype)))
        return ob[None], os1[None], os2[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    outs = f(*(shard(a) for name in ("big", "small") for a in data[name]))
    ob, os1, os2 = (local(o) for o in outs)

    def want(x, idx, E, scale=1.0):
        # non-expand: each rank that a token reaches returns x once; fp32 sum, one bf16 rounding
        hits = np.stack([((idx >= 0) & (idx // (E // R) == d)).any(-1) for d in range(R)], -1).sum(-1)
        return (x.astype(np.float32) * scale * hits[:, None]).astype(jnp.bfloat16)

    Eb, Es = cfgs["big"]["E"], cfgs["small"]["E"]
    for r in ob:
        wb = want(data["big"][0][r], data["big"][1][r], Eb)
        ws1 = want(data["small"][0][r], data["small"][1][r], Es)
        ws2 = want(data["small"][0][r], data["small"][1][r], Es, 2.0)
        for it in range(iters):
            for what, got, w in (("big", ob[r][it], wb), ("small", os1[r][it], ws1), ("small cached", os2[r][it], ws2)):
                if not same(got, w):
                    return False, f"{what} combine(dispatch(x)) wrong on rank {r}, iteration {it}"
    paths = {name: ctx.dispatch_path(max_tokens_per_rank=c["M"], hidden_bytes=c["H"] * 2, topk=c["K"],
                                     num_experts=c["E"]) for name, c in cfgs.items()}
    return True, f"paths={paths}"
