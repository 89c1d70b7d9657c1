"""The one-rank EP path (jax_engram/_ep_local.py) against the native kernels and jax_engram.reference, bit for bit,
and its errors against the kernels' errors.

One CPU device (JAX_ENGRAM_EP_LOCAL_PLATFORM=cuda: one GPU), one context on the local path (the default at one
rank, ``EPConfig.one_rank='local'``) and one on the native kernels (``EPConfig.one_rank='kernels'``). Each seeded
random case (layout,
alignment, zero padding, K, E, N, M, dtype, FP8 with float32 / int32 scales, -1 ids, weights or None, 0-2 biases)
runs ONE jitted program per path: dispatch, a cached dispatch of new x / weights, combine of a random y, and the vjp
of dispatch -> experts -> combine. Every output the contract defines is compared between the paths and with the
reference. The seed is fresh every run and printed (JAX_ENGRAM_EP_LOCAL_SEED replays it; JAX_ENGRAM_EP_LOCAL_CASES
sets the number of cases).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_engram as je
from jax_engram import reference as ref

PLATFORM = os.environ.get("JAX_ENGRAM_EP_LOCAL_PLATFORM", "cpu")  # "cuda": the same cases on one GPU
SEED = int(os.environ.get("JAX_ENGRAM_EP_LOCAL_SEED", "0")) or int(np.random.SeedSequence().entropy % (1 << 31))
CASES = int(os.environ.get("JAX_ENGRAM_EP_LOCAL_CASES", "6"))
AX = "ep"


@pytest.fixture(scope="module")
def contexts():
    mesh = jax.make_mesh((1,), (AX,), devices=jax.devices(PLATFORM)[:1])
    local = je.init(mesh, AX)
    native = je.init(mesh, AX, ep_config=je.EPConfig(one_rank="kernels"))
    yield mesh, local, native
    native.close()
    local.close()


def _bits(a):
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float8_e4m3fn"):
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    return a


def _draw(rng):
    expand = bool(rng.integers(2))
    E = int(rng.choice([1, 3, 8, 16, 64]))
    K = int(rng.integers(1, min(E, 9) + 1))
    M = int(rng.integers(1, 40))
    N = int(rng.integers(1, M + 1))
    return dict(expand=expand, A=int(rng.choice([1, 8])), zero_padding=expand and bool(rng.integers(2)), E=E, K=K,
                N=N, M=M, H=int(rng.choice([16, 32, 48])),
                dtype=str(rng.choice(["bfloat16", "float32", "float16", "float8_e4m3fn"] if PLATFORM == "cpu"
                                     else ["bfloat16", "float8_e4m3fn"])),  # GPU kernels: bf16 combines
                sf=str(rng.choice(["float32", "int32"])), P=int(rng.integers(1, 4)), weights=bool(rng.integers(4)),
                masked=float(rng.choice([0.0, 0.2, 0.6])), biases=int(rng.integers(3)),
                y32=PLATFORM == "cpu" and bool(rng.integers(4) == 0))  # float32 y: the CPU kernels


def _inputs(c, rng):
    N, K, E, H = c["N"], c["K"], c["E"], c["H"]
    idx = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
    idx[rng.random((N, K)) < c["masked"]] = -1
    xf = rng.standard_normal((N, H)).astype(np.float32)
    xf[rng.random((N, H)) < 0.05] = -0.0
    x = jnp.asarray(xf).astype(c["dtype"])
    fp8 = c["dtype"] == "float8_e4m3fn"
    sf = None
    if fp8:
        sf = (rng.standard_normal((N, c["P"])).astype(np.float32) if c["sf"] == "float32"
              else rng.integers(-2 ** 31, 2 ** 31 - 1, (N, c["P"]), dtype=np.int64).astype(np.int32))
    w = rng.standard_normal((N, K)).astype(np.float32) if c["weights"] else None
    x2 = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)).astype(c["dtype"])
    w2 = rng.standard_normal((N, K)).astype(np.float32) if c["weights"] else None
    rows = ref.expand_rows(1, c["M"], K, E, c["A"]) if c["expand"] else c["M"]
    ydt = jnp.float32 if c["y32"] else jnp.bfloat16
    y = jnp.asarray(rng.standard_normal((rows, H)).astype(np.float32)).astype(ydt)
    yw = rng.standard_normal((rows,) if c["expand"] else (rows, K)).astype(np.float32)
    bias = tuple(jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)).astype(ydt) for _ in range(c["biases"]))
    ct_x = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)).astype(ydt)
    ct_w = rng.standard_normal((N, K)).astype(np.float32)
    return dict(x=x, idx=idx, w=w, sf=sf, x2=x2, w2=w2, y=y, yw=yw, bias=bias, ct_x=ct_x, ct_w=ct_w)


def _program(ctx, mesh, c, d):
    kw = dict(ctx=ctx, num_experts=c["E"], max_tokens_per_rank=c["M"], expand=c["expand"],
              expert_alignment=c["A"], zero_padding=c["zero_padding"])
    fp8 = c["dtype"] == "float8_e4m3fn"
    ydt = d["y"].dtype

    def body(x, idx, w, sf, x2, w2, y, yw, bias, ct_x, ct_w):
        res = je.dispatch(x, idx, w, x_scales=sf, **kw)
        cached = je.dispatch(x2, None, w2, x_scales=sf, handle=res.handle, **kw)
        comb = je.combine(y, res.handle, topk_weights=yw, bias=bias or None)

        def model(x, w, y, bias):  # dispatch -> experts -> combine
            r = je.dispatch(x, idx, w, x_scales=sf, **kw)
            h = (r.recv_x.astype(jnp.float32) * 1.5).astype(ydt) + y
            cw = r.recv_topk_weights * 2.0 if r.recv_topk_weights is not None else None
            out = je.combine(h, r.handle, topk_weights=cw, bias=bias or None)
            return out.combined_x, out.combined_topk_weights

        primals = (x, w, y, bias)
        diff = (lambda x, w, y, b: model(x, w, y, b)) if not fp8 else (lambda w, y, b: model(x, w, y, b))
        outs, vjp = jax.vjp(diff, *(primals if not fp8 else primals[1:]))
        grads = vjp((ct_x, ct_w if w is not None else None))
        return res, cached, comb, outs, grads

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    return f(d["x"], d["idx"], d["w"], d["sf"], d["x2"], d["w2"], d["y"], d["yw"], d["bias"], d["ct_x"],
             d["ct_w"])


def _same(a, b, what, rows=None):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    a, b = _bits(a), _bits(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if rows is not None:
        a, b = a[np.asarray(rows)], b[np.asarray(rows)]
    np.testing.assert_array_equal(a, b, err_msg=what)


def _compare_dispatch(a, b, c, token_ok, row_ok, tag):
    _same(a.recv_x, b.recv_x, f"{tag} recv_x", row_ok)
    _same(a.recv_x_scales, b.recv_x_scales, f"{tag} recv_x_scales", row_ok)
    _same(a.recv_topk_weights, b.recv_topk_weights, f"{tag} recv_topk_weights",
          row_ok if c["expand"] else token_ok)


def _compare_handle(a, b, c, token_ok, tag):
    _same(a.recv_topk_idx, b.recv_topk_idx, f"{tag} recv_topk_idx", None if a.recv_topk_idx is None else token_ok)
    for f in ("num_recv_tokens", "group_sizes"):
        _same(getattr(a, f), getattr(b, f), f"{tag} {f}")
    ha, hb = a.handle, b.handle
    for f in ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
              "num_unaligned_recv_tokens_per_expert", "dst_row", "topk_idx"):
        _same(getattr(ha, f), getattr(hb, f), f"{tag} handle.{f}")
    cols = slice(None) if c["expand"] else slice(0, 2)  # non-expand: [:, 2:] is not defined
    _same(np.asarray(ha.recv_src_metadata)[:, cols], np.asarray(hb.recv_src_metadata)[:, cols],
          f"{tag} handle.recv_src_metadata", token_ok)


@pytest.mark.parametrize("ranking", ["native", "sort"])
def test_one_rank_path_matches_native_and_reference(contexts, ranking, monkeypatch):
    """``ranking``: how the expand layout is computed (_ep_local._NATIVE_LAYOUT_MAX_ENTRIES): "native" the dispatch
    call, "sort" the stable sort in JAX and the row scatter (the same layout, computed another way)."""
    from jax_engram import _ep_local
    if ranking == "sort":
        monkeypatch.setattr(_ep_local, "_NATIVE_LAYOUT_MAX_ENTRIES", 0)
    mesh, local, native = contexts
    print(f"test_ep_local seed {SEED} (replay: JAX_ENGRAM_EP_LOCAL_SEED={SEED})")
    rng = np.random.default_rng(SEED)
    ran = 0
    for case in range(CASES):
        c = _draw(rng)
        d = _inputs(c, rng)
        tag = f"seed {SEED} case {case} {c}"
        lo = _program(local, mesh, c, d)
        na = _program(native, mesh, c, d)
        rd = ref.ep_dispatch(d["x"][None], d["idx"][None], None if d["w"] is None else d["w"][None],
                             num_experts=c["E"], max_tokens_per_rank=c["M"], expand=c["expand"],
                             expert_alignment=c["A"], zero_padding=c["zero_padding"],
                             x_scales=None if d["sf"] is None else d["sf"][None])
        rd = ref.per_rank(rd, 0)
        token_ok, row_ok = np.asarray(rd["recv_token_valid"]), np.asarray(rd["recv_row_defined"])
        (res_l, cached_l, comb_l, outs_l, grads_l), (res_n, cached_n, comb_n, outs_n, grads_n) = lo, na
        for other, name in ((res_n, "native"), (None, "reference")):
            if other is None:
                class _R:  # the reference's dict seen through the result's field names
                    recv_x, recv_x_scales = rd["recv_x"], rd["recv_x_scales"]
                    recv_topk_weights = rd["recv_topk_weights"]
                other = _R
            _compare_dispatch(res_l, other, c, token_ok, row_ok, f"{tag} dispatch vs {name}")
        _compare_handle(res_l, res_n, c, token_ok, f"{tag} vs native")
        for f in ("num_recv_tokens", "group_sizes", "psum_num_recv_tokens_per_rank",
                  "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert"):
            got = getattr(res_l, f) if hasattr(res_l, f) else getattr(res_l.handle, f)
            _same(got, np.asarray(rd[f]).reshape(np.shape(got)), f"{tag} {f} vs reference")
        cols = slice(None) if c["expand"] else slice(0, 2)
        _same(np.asarray(res_l.handle.recv_src_metadata)[:, cols], np.asarray(rd["recv_src_metadata"])[:, cols],
              f"{tag} recv_src_metadata vs reference", token_ok)
        _compare_dispatch(cached_l, cached_n, c, token_ok, row_ok, f"{tag} cached dispatch vs native")
        _same(comb_l.combined_x, comb_n.combined_x, f"{tag} combined_x vs native")
        _same(comb_l.combined_topk_weights, comb_n.combined_topk_weights, f"{tag} combined_topk_weights vs native")
        if not c["y32"]:
            want_x, want_w = ref.ep_combine(d["y"][None], {k: v[None] for k, v in rd.items() if v is not None},
                                            d["idx"][None], num_experts=c["E"], max_tokens_per_rank=c["M"],
                                            expand=c["expand"], topk_weights=d["yw"][None],
                                            bias=tuple(b[None] for b in d["bias"]) or None)
            _same(comb_l.combined_x, want_x[0], f"{tag} combined_x vs reference")
            _same(comb_l.combined_topk_weights, want_w[0], f"{tag} combined_topk_weights vs reference")
        for i, (a, b) in enumerate(zip(outs_l, outs_n)):
            _same(a, b, f"{tag} model output {i} vs native")
        la, lb = jax.tree.leaves(grads_l), jax.tree.leaves(grads_n)
        assert len(la) == len(lb) and la, tag
        for i, (a, b) in enumerate(zip(la, lb)):
            _same(a, b, f"{tag} gradient {i} vs native")
        ran += 1
    assert ran == CASES


# (N, K, E, expert_alignment, M): the dispatch call's extremes (jax_engram_ep_local_dispatch; CUDA ep_local.cu). One
# kernel: every entry, token and expert its shared memory holds (top-1), top-32 of the most experts one rank has, a
# wide alignment and M > N, the bench's T = 128 shape, one entry. Chunked (above 2048 entries, chunks of whole tokens
# of at most 2048 entries): one entry past the kernel's (two chunks, the second of one token), the bench's largest
# shape (16 chunks), top-32 in chunks of 64 tokens with a wide alignment and M > N, one expert (every entry in one
# segment across 3 chunks), a last chunk of one token.
_LAYOUT_LIMITS = [(2048, 1, 256, 1, 2048), (64, 32, 256, 4, 64), (256, 8, 256, 128, 300), (128, 8, 256, 1, 128),
                  (1, 1, 1, 1, 1),
                  (2049, 1, 7, 3, 2100), (4096, 8, 256, 1, 4096), (300, 32, 256, 128, 333), (5000, 1, 1, 1, 5000),
                  (1025, 4, 64, 8, 1025)]


@pytest.mark.parametrize("N,K,E,A,M,H", [c + (8,) for c in _LAYOUT_LIMITS] + [(3000, 2, 16, 4, 3000, 0)])
def test_native_layout_matches_the_sort_at_its_limits(contexts, N, K, E, A, M, H, monkeypatch):
    """The dispatch call against the stable sort in JAX and the row scatter (which the seeded cases compare with the
    reference), every handle array and receive array bit for bit (padding rows included), at the sizes where the
    kernels' limits are."""
    from jax_engram import _ep_local
    mesh, local, _ = contexts
    rng = np.random.default_rng(N * 7919 + K * 131 + E)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
    idx[rng.random((N, K)) < 0.25] = -1
    x = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)).astype(jnp.bfloat16)  # H = 0: no row moves
    w = rng.standard_normal((N, K)).astype(np.float32)
    kw = dict(ctx=local, num_experts=E, max_tokens_per_rank=M, expand=True, expert_alignment=A, zero_padding=True)

    def run():
        f = jax.jit(jax.shard_map(lambda x, i, w: je.dispatch(x, i, w, **kw), mesh=mesh, in_specs=P(),
                                  out_specs=P(), check_vma=False))
        return jax.tree.map(np.asarray, f(x, idx, w))

    assert 0 < N * K <= _ep_local._NATIVE_LAYOUT_MAX_ENTRIES
    native = run()
    monkeypatch.setattr(_ep_local, "_NATIVE_LAYOUT_MAX_ENTRIES", 0)
    sort = run()
    la, lb = jax.tree.leaves(native), jax.tree.leaves(sort)
    assert len(la) == len(lb) and la
    for i, (a, b) in enumerate(zip(la, lb)):
        _same(a, b, f"N={N} K={K} E={E} A={A} M={M} H={H}: leaf {i}")


@pytest.mark.parametrize("alignment,words", [(1 << 31, "expert_alignment=2147483648"),
                                             (1 << 29, "last row below 2^31")])
def test_native_layout_refuses_layouts_past_int32(contexts, alignment, words):
    """The dispatch call's own check (a caller other than _ep_local could pass these): rows and segment starts are
    int32 in both kernels, so a layout whose last row reaches 2^31 is refused. (The metadata's own bound needs a
    buffer of 2^31 entries to reach, too large for a test.)"""
    from jax_engram import _call
    mesh, local, _ = contexts
    N, K, E, M = 2, 3, 8, 4
    rows = 16

    def body(t):
        shapes = ((N, K), (rows,), (rows,), (E,), (E,), (E,), (M, K + 2), (N, 1), (1,), (0,))  # no scratch: 6 entries
        token, x, w = jnp.zeros((), jnp.int32), jnp.zeros((N, 16), jnp.bfloat16), jnp.zeros((N * K,), jnp.float32)
        results = [_call.like(token), _call.like(x, (rows, 16)), _call.like(w, (rows,))]
        return _call.call(local, "jax_engram_ep_local_dispatch",
                          results + [_call.like(t, sh, jnp.int32) for sh in shapes], token, t, x, w,
                          expert_alignment=alignment)[3]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    with pytest.raises(Exception, match=re.escape(words)):
        jax.block_until_ready(f(np.zeros((N, K), np.int32)))


def test_one_rank_path_calls_only_its_guard_and_dispatch_call_and_takes_no_region(contexts):
    mesh, local, native = contexts
    N, H, K, E = 16, 16, 4, 8

    def program(ctx):
        def body(x, idx, w):
            r = je.dispatch(x, idx, w, ctx=ctx, num_experts=E, max_tokens_per_rank=N, expand=True,
                            expert_alignment=8)
            c = je.combine(r.recv_x, r.handle, topk_weights=r.recv_topk_weights, after=r.done)
            return c.combined_x, c.done
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))

    args = (jnp.ones((N, H), jnp.bfloat16), jnp.tile(jnp.arange(K, dtype=jnp.int32), (N, 1)), jnp.ones((N, K)))
    regions = dict(local._regions)
    hlo = program(local).lower(*args).as_text()
    out, _ = program(local)(*args)
    targets = sorted(set(re.findall(r"custom_call @(jax_engram_\w+)", hlo)))
    # the combine's guard and the dispatch's one call (its own guard at this size): no EP kernel, no row scatter
    assert targets == ["jax_engram_ep_guard", "jax_engram_ep_local_dispatch"], targets
    assert hlo.count("@jax_engram_ep_guard(") == 1 and hlo.count("@jax_engram_ep_local_dispatch(") == 1, hlo
    assert local._regions == regions
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((N, H), K, np.float32))
    assert "jax_engram_ep_dispatch" in program(native).lower(*args).as_text()  # the switch reaches the kernels
    # the dispatch call carries the op's token (aliased in place), so it keeps its place in the context's chain of ops
    compiled = program(local).lower(*args).compile().as_text()
    layout = [ln for ln in compiled.splitlines() if 'custom_call_target="jax_engram_ep_local_dispatch"' in ln]
    assert len(layout) == 1 and "output_to_operand_aliasing={{0}: (0, {})}" in layout[0], layout


def _scatter_rule(x, dest, src):
    """numpy: row r is x[src[r]] where that token lists r in dest, else zero (ep_local_scatter's rule)."""
    N = x.shape[0]
    out = np.zeros((src.shape[0],) + x.shape[1:], x.dtype)
    for r, s in enumerate(src):
        if 0 <= s < N and r in dest[s]:
            out[r] = x[s]
    return out


@pytest.mark.parametrize("dtype,H", [("bfloat16", 16), ("float8_e4m3fn", 7), ("float32", 3), ("bfloat16", 0)])
def test_scatter_rows_follows_the_owner_rule_whatever_dest_and_src_hold(contexts, dtype, H):
    """The native scatter (jax_engram_ep_local_scatter) writes row r from token src[r] only where that token lists r,
    zeroes every other row, and gives every row one writer even where dest and src disagree (a handle's metadata
    rebuilds them): two tokens listing one row, a row whose source does not list it, rows outside the receive rows.
    Row sizes of 16, 7 and 12 bytes take the kernel's 16-, 1- and 4-byte words; H = 0 moves nothing."""
    from types import SimpleNamespace

    from jax_engram import _ep_local

    mesh, local, _ = contexts
    rng = np.random.default_rng(SEED)
    N, K, rows = 5, 3, 23
    cases = [(np.array([[0, 2, -1], [2, 5, 40], [-1, 9, 9], [3, 3, 4], [-7, -1, 22]], np.int32),
              np.array([0, 1, 2, 3, 1, 1, 5, -3, 4] + [N] * 13 + [4], np.int32))]
    for _ in range(4):
        cases.append((rng.integers(-2, rows + 3, (N, K)).astype(np.int32),
                      rng.integers(-2, N + 2, (rows,)).astype(np.int32)))
    cfg = SimpleNamespace(ctx=local)
    fn = jax.jit(jax.shard_map(lambda x, d, s: _ep_local._scatter_rows(cfg, x, d, s), mesh=mesh,
                               in_specs=(P(), P(), P()), out_specs=P(), check_vma=False))
    for dest, src in cases:
        x = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)).astype(dtype)
        out = fn(x, jnp.asarray(dest), jnp.asarray(src))
        assert out.shape == (rows, H) and out.dtype == x.dtype
        np.testing.assert_array_equal(_bits(out), _bits(_scatter_rule(np.asarray(x), dest, src)), err_msg=str(dest))


def test_one_rank_path_is_chosen_in_ep_path_and_differentiated_by_the_shared_rules(contexts, monkeypatch):
    # jax_engram.ep._path picks the path per context and EPConfig; the one-rank path defines no gradient rule of its
    # own: the backward of its dispatch is its combine_impl and the backward of its combine its cached_impl, under
    # _ep_autodiff's one custom_vjp per op (as for the flat and hierarchical paths)
    from types import SimpleNamespace
    from jax_engram import _ep_flat, _ep_local, ep
    mesh, local, native = contexts
    assert ep._path(SimpleNamespace(ctx=local, ep=local.ep_config)) is _ep_local
    assert ep._path(SimpleNamespace(ctx=native, ep=native.ep_config)) is _ep_flat
    assert ep._path(SimpleNamespace(ctx=local, ep=je.EPConfig(one_rank="kernels"))) is _ep_flat
    assert not [n for n, v in vars(_ep_local).items() if isinstance(v, jax.custom_vjp)]
    assert not [n for n, v in vars(_ep_flat).items() if isinstance(v, jax.custom_vjp)]

    calls = []
    for name in ("dispatch_impl", "cached_impl", "combine_impl"):
        def counted(*a, _name=name, _f=getattr(_ep_local, name)):
            calls.append(_name)
            return _f(*a)
        monkeypatch.setattr(_ep_local, name, counted)
    N, H, K, E = 8, 16, 2, 4
    kw = dict(ctx=local, num_experts=E, max_tokens_per_rank=N)
    idx = jnp.tile(jnp.arange(K, dtype=jnp.int32), (N, 1))

    def grads(x):
        def loss(x):
            r = je.dispatch(x, idx, **kw)
            return je.combine(r.recv_x, r.handle).combined_x.sum()
        return jax.grad(loss)(x)
    f = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    g = f(jnp.ones((N, H), jnp.float32))
    np.testing.assert_array_equal(np.asarray(g), np.ones((N, H), np.float32))  # one row per token and rank
    # forward: dispatch + combine; backward: combine's (a cached dispatch), then dispatch's (a combine)
    assert sorted(calls) == ["cached_impl", "combine_impl", "combine_impl", "dispatch_impl"], calls


# ------------------------------------------------------------------------------------------------- errors
# At one rank the local path must fail exactly where the kernels fail, with the same exceptions and messages (the
# context id aside): bad routing (the call on CPU, the next op on GPU; ctx.check() in both), every op of a context
# with an error, every op of a closed context.
# What a failed jitted call raises: jax.errors.JaxRuntimeError, or ValueError when the failure surfaces in JAX's
# C++ dispatch path (a function that has run before; it turns every failed status into ValueError,
# jax-ml/jax#34083), whichever the timing gives; same message (docs/semantics.md, "Errors").
_CALL_ERRORS = ("JaxRuntimeError", "ValueError")


def _outcome(fn, ctx):
    """(exception type name, message with the context id replaced) of fn(), or ("ok", ""); a failed call's
    JaxRuntimeError / ValueError is "call error"."""
    try:
        jax.block_until_ready(fn())
    except Exception as e:  # noqa: BLE001 - compared between the paths
        kind = "call error" if type(e).__name__ in _CALL_ERRORS else type(e).__name__
        return kind, str(e).replace(f"context {ctx.id} ", "context <id> ")
    return "ok", ""


def _bad_routing_outcomes(mesh, one_rank, N, K, E, idx, expand):
    ctx = je.init(mesh, AX, ep_config=je.EPConfig(one_rank=one_rank), timeout_s=30)
    try:
        def body(x, idx):
            return je.dispatch(x, idx, ctx=ctx, num_experts=E, max_tokens_per_rank=N, expand=expand).recv_x
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        x = jnp.ones((N, 16), jnp.bfloat16)
        good = np.where(np.arange(K)[None, :] < min(K, E), np.arange(K)[None, :], -1).repeat(N, 0).astype(np.int32)
        first = _outcome(lambda: f(x, good), ctx)
        return [first, _outcome(lambda: f(x, idx), ctx), _outcome(ctx.check, ctx), _outcome(lambda: f(x, good), ctx),
                _outcome(ctx.check, ctx)]
    finally:
        ctx.close()


def _routing(N, K, E, bad):
    idx = np.full((N, K), -1, np.int32)
    idx[:, :min(K, E)] = np.arange(min(K, E))
    for (t, k), v in bad.items():
        idx[t, k] = v
    return idx


# (N, K, E, {(token, k): id}, the first bad entry's words in the message)
_BAD = {
    "duplicate": (8, 2, 4, {(3, 0): 1}, ["token 3", "lists expert 1 more than once"]),
    "above_range": (8, 2, 4, {(5, 1): 4}, ["token 5", "holds expert id 4 outside [-1, num_experts"]),
    "below_minus_one": (8, 2, 4, {(2, 0): -7}, ["token 2", "holds expert id -7 outside [-1"]),
    "first_of_several": (12, 4, 8, {(9, 0): 99, (4, 3): 2, (4, 2): -5, (7, 1): 0},
                         ["token 4", "holds expert id -5 outside"]),
    "range_before_duplicate": (6, 3, 4, {(1, 0): 9, (1, 1): 9, (1, 2): 1}, ["token 1", "holds expert id 9"]),
    "duplicate_of_masked_is_fine": (6, 3, 4, {(2, 0): -1, (2, 1): -1, (2, 2): 3, (3, 2): 0},
                                    ["token 3", "lists expert 0 more than once"]),
    # more tokens than one round of the CUDA guard's threads, K past a register bucket (ep_guard.cu)
    "wide": (2100, 20, 64, {(2050, 19): 5, (1999, 17): 64, (1025, 13): 12}, ["token 1025", "lists expert 12"]),
    "top32": (40, 32, 32, {(39, 31): 0}, ["token 39", "lists expert 0 more than once"]),
    # bad tokens in three of the CUDA guard's CTAs (256 tokens each), 16-byte rows: the earliest one is recorded
    "three_ctas": (1000, 8, 16, {(900, 3): 16, (770, 0): -5, (520, 1): 2, (520, 5): 2},
                   ["token 520", "lists expert 2 more than once"]),
}


@pytest.mark.parametrize("name", sorted(_BAD))
def test_one_rank_bad_routing_fails_as_the_kernels_fail(contexts, name):
    mesh = contexts[0]
    N, K, E, bad, words = _BAD[name]
    idx = _routing(N, K, E, bad)
    # expand: the dispatch call checks the routing itself ("wide": 42,000 entries, the chunked kernels on CUDA)
    expand = name in ("first_of_several", "wide", "duplicate", "range_before_duplicate", "top32")
    got = _bad_routing_outcomes(mesh, "local", N, K, E, idx, expand)
    want = _bad_routing_outcomes(mesh, "kernels", N, K, E, idx, expand)
    assert got == want, f"{name}:\nlocal   {got}\nkernels {want}"
    assert got[0] == ("ok", "")  # good routing runs
    checked = got[2]  # ctx.check() after the bad call: the kernels' error, recorded in the context
    assert checked[0] == "JaxEngramError" and all(w in checked[1] for w in words), checked
    assert "The context is unusable" in checked[1]
    if PLATFORM == "cpu":  # the CPU kernels fail the call itself (its message also names num_experts' value)
        kind, msg = got[1]
        assert kind == "call error", got[1]
        assert msg.startswith("INVALID_ARGUMENT: jax_engram ep dispatch on rank 0"), got[1]
        assert all(w in msg for w in words) and "The context is unusable" in msg, got[1]
    assert got[3][0] == "call error" and checked[1] in got[3][1]  # the context refuses every later op
    assert got[4] == checked


def _closed_outcomes(mesh, one_rank):
    """Each program of a context compiled and run while it is open, then called after ctx.close()."""
    ctx = je.init(mesh, AX, ep_config=je.EPConfig(one_rank=one_rank), timeout_s=30)
    N, H, K, E = 8, 16, 2, 4
    kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=N, expand=True)

    def jit(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))

    def round_trip(x, i):
        r = je.dispatch(x, i, **kw)
        return je.combine(r.recv_x.astype(jnp.bfloat16), r.handle).combined_x

    x = jnp.ones((N, H), jnp.bfloat16)
    idx = np.tile(np.arange(K, dtype=np.int32), (N, 1))
    whole = jit(round_trip)
    disp = jit(lambda x, i: je.dispatch(x, i, **kw).handle)
    handle = disp(x, idx)
    cached = jit(lambda x, h: je.dispatch(x, None, handle=h, **kw).recv_x)
    comb = jit(lambda y, h: je.combine(y, h).combined_x)
    y = jnp.ones((ref.expand_rows(1, N, K, E, 1), H), jnp.bfloat16)
    grad = jit(lambda x, i: jax.grad(lambda x: round_trip(x, i).astype(jnp.float32).sum())(x))
    runs = {"dispatch + combine": lambda: whole(x, idx), "dispatch": lambda: disp(x, idx),
            "cached dispatch": lambda: cached(x, handle), "combine": lambda: comb(y, handle),
            "gradient": lambda: grad(x.astype(jnp.float32), idx)}
    try:
        before = {k: _outcome(f, ctx) for k, f in runs.items()}
    finally:
        ctx.close()
    after = {k: _outcome(f, ctx) for k, f in runs.items()}
    return before, after


def test_one_rank_closed_context_refuses_compiled_ops_as_the_kernels_do(contexts):
    mesh = contexts[0]
    got, want = _closed_outcomes(mesh, "local"), _closed_outcomes(mesh, "kernels")
    assert got == want, f"local   {got}\nkernels {want}"
    before, after = got
    assert all(v == ("ok", "") for v in before.values()), before
    for name, (kind, msg) in after.items():
        op = "combine" if name == "combine" else "dispatch"
        assert kind == "call error" and msg.startswith(f"FAILED_PRECONDITION: jax_engram ep {op}: no jax_engram "
                                                            "context"), (name, kind, msg)


def test_dispatch_kernels_match_a_sequential_reference(tmp_path):
    """tests/cuda/local_dispatch_check.cu: the dispatch call's CUDA launch (one kernel up to 2048 entries, chunked
    kernels above, up to 100,000 x 8) against a sequential statement of its rule, every output and the error record
    bit for bit, clean and bad routings, each case launched twice. Built with nvcc wherever nvcc is (CI: the build
    must pass); run on the GPU (test_one_gpu's run of this file)."""
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc missing -- CI must build the CUDA checks")
        pytest.skip("nvcc missing")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = str(tmp_path / "local_dispatch_check")
    b = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-Iffi", "-Iffi/include", "-o", exe,
                        "tests/cuda/local_dispatch_check.cu", "ffi/kernels/cuda/ep_local.cu"], cwd=root,
                       capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stdout[-4000:] + b.stderr[-4000:]
    if PLATFORM != "cuda":
        return  # built; it runs where there is a GPU
    r = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ALL OK"), r.stdout[-6000:] + r.stderr[-2000:]


@pytest.mark.gpu(1)
def test_one_gpu():
    """This file's tests on one GPU (the CUDA guard kernel and handlers against the CUDA kernels)."""
    if PLATFORM != "cpu":
        pytest.skip("already on the GPU")
    env = dict(os.environ, JAX_ENGRAM_EP_LOCAL_PLATFORM="cuda", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not test_one_gpu"], capture_output=True, text=True, timeout=1200, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-4000:]
