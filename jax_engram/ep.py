"""MoE expert-parallel dispatch / combine (DeepEP V2 direct mode) as jit-able, differentiable JAX ops.

Call inside ``jax.shard_map`` over the context's mesh axis (local shapes), under ``jax.jit``::

    res = jax_engram.dispatch(x, topk_idx, topk_weights, ctx=ctx, num_experts=E, max_tokens_per_rank=M,
                              expand=True, expert_alignment=128, zero_padding=True)
    y = expert_mlp(res.recv_x, res.group_sizes) * res.recv_topk_weights[:, None]
    out = jax_engram.combine(y.astype(jnp.bfloat16), res.handle).combined_x

Shapes are static worst cases (R ranks, M = max_tokens_per_rank, K = top-k, E_loc = E / R, A = alignment):
non-expand ``recv_x`` is ``[R*M, H]`` (rows grouped by source rank, then source token), expand ``recv_x`` is
``[align(R*M*min(K,E_loc) + (A-1)*E_loc, A), H]`` (per local expert a segment at
``start[e] = sum_{j<e} align(count_j, A)``, rows sorted by source global id ``src_rank*M + t``). The real
counts are device data (``num_recv_tokens``, ``group_sizes``, the handle's psums), so a changing number of
routed tokens never recompiles. Rows past the real count are unspecified (only alignment padding rows are
defined, and only with ``zero_padding=True``).

Semantics: ``docs/semantics.md`` ("MoE dispatch", "MoE combine"); they are tested bit-exactly against
:mod:`jax_engram.reference`. Notes:

* The receive order is always canonical: the receiver pulls rows in the reference (= DeepEP
  deterministic-mode) order, run to run (``deterministic=`` is deprecated and does nothing).
* ``combine`` is an UNWEIGHTED sum (fp32 accumulation, one rounding per reduction level, bias first, ranks
  in ascending order of the token's master top-k position). Apply routing weights yourself before it
  (multiply the expert outputs by ``recv_topk_weights``); ``combine(topk_weights=...)`` only routes weights
  back to the source tokens (``combined_topk_weights``).
* Ordering: every op takes and returns an opaque ``token`` (a float32 scalar, as for every jax_engram op). ``combine`` follows its
  dispatch through ``handle.token``; pass ``token=`` explicitly to order EP ops that are not otherwise
  connected by data (e.g. two micro-batches): every rank must run the same sequence of EP ops on a context.
  The gradient pass is ordered the same way, in reverse (the token's cotangent carries the order).
* Autodiff (``jax.custom_vjp``): d dispatch / d x = combine of the ``recv_x`` cotangent (fp32 sums);
  d dispatch / d topk_weights = the combine's routing of the ``recv_topk_weights`` cotangent (as in DeepEP,
  non-expand: the cotangent of copies at top-k positions whose expert is not on the receiving rank is
  dropped); d combine / d y = cached dispatch of the ``combined_x`` cotangent (rows combine did not read get
  0), d combine / d topk_weights = its routing back, d bias = the cotangent.
* Buffers: staging regions are sized from M, hidden, K and dtype on first use (``ctx.region``), carved from
  the context's ``device_bytes`` reservation if one was given (a too-small one fails with the bytes needed).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_local, _ffi
from jax_engram.config import EPConfig, ep_config as _ep_config
from jax_engram.context import Context, JaxEngramError

__all__ = ["dispatch", "combine", "DispatchResult", "CombineResult", "EPHandle", "dispatch_staging_bytes",
           "combine_staging_bytes", "expand_rows", "MAX_TOPK"]

_X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
_SF_DTYPES = (jnp.float32, jnp.int32)
_COMBINE_DTYPES = (jnp.bfloat16, jnp.float32)


# ------------------------------------------------------------------------------------------- layout figures
# Every figure and limit comes from the native layout header (ffi/include/jax_engram/ep_layout.h) through the CPU
# module, which is always built; nothing here computes its own copy.
_layout = _ffi.native("cpu")
MAX_TOPK: int = _layout.ep_limits["max_topk"]
MAX_LOCAL_EXPERTS: int = _layout.ep_limits["max_local_experts"]
MAX_EXPERTS: int = _layout.ep_limits["max_experts"]


def expand_rows(R: int, M: int, K: int, E_loc: int, A: int) -> int:
    """Rows of the expand receive layout: ``align(R*M*min(K,E_loc) + (A-1)*E_loc, A)`` (ep_rows_expand)."""
    return int(_layout.ep_rows(True, R, M, K, E_loc, A))


def dispatch_staging_bytes(R: int, M: int, K: int, E: int, hidden_bytes: int, num_scales: int,
                           push: bool = False) -> int:
    """Bytes of a dispatch staging region (EpDispatchLayout::total_bytes in ep_layout.h); ``push`` is the CUDA
    protocol (inbox slots on the receiver instead of staged rows on the sender)."""
    return int(_layout.ep_dispatch_bytes(R, M, K, E, hidden_bytes, num_scales, bool(push)))


def combine_staging_bytes(R: int, M: int, K: int, hidden_bytes: int, push: bool = False) -> int:
    """Bytes of a combine staging region (EpCombineLayout::total_bytes in ep_layout.h)."""
    return int(_layout.ep_combine_bytes(R, M, K, hidden_bytes, bool(push)))


# --------------------------------------------------------------------------------------------- pytrees
@dataclasses.dataclass(frozen=True)
class _Config:
    """Static configuration of a dispatch (aux data of its handle)."""

    ctx: Any
    num_ranks: int
    num_experts: int
    max_tokens_per_rank: int
    num_tokens: int
    topk: int
    expand: bool
    expert_alignment: int
    num_sms: int
    ep: EPConfig = EPConfig()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows(self) -> int:
        return int(_layout.ep_rows(self.expand, self.num_ranks, self.max_tokens_per_rank, self.topk,
                                   self.num_local_experts, self.expert_alignment))

    @property
    def token_rows(self) -> int:
        return self.num_ranks * self.max_tokens_per_rank

    def attrs(self) -> dict:
        """The attributes every EP op of this config passes (EpDispatchAttrs / EpCombineAttrs in ep_bindings.h)."""
        return dict(num_experts=self.num_experts, max_tokens_per_rank=self.max_tokens_per_rank,
                    expand=int(self.expand), num_sms=self.num_sms)

    def dispatch_attrs(self, copy_pieces: int, zero_padding: bool) -> dict:
        return dict(self.attrs(), expert_alignment=self.expert_alignment, zero_padding=int(zero_padding),
                    copy_pieces=copy_pieces, stage_warps=self.ep.dispatch_stage_warps or 0)

    def combine_attrs(self) -> dict:
        return dict(self.attrs(), stage_warps=self.ep.combine_stage_warps or 0)


_HANDLE_FIELDS = ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_row", "topk_idx",
                  "num_recv_tokens", "group_sizes", "recv_topk_idx", "token")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_HANDLE_FIELDS), meta_fields=["config"])
@dataclasses.dataclass(frozen=True, repr=False)
class EPHandle:
    """What combine and cached dispatch need to reverse / replay a dispatch: a frozen pytree (device arrays
    are leaves, the static configuration ``config`` is aux data). Per rank (inside ``shard_map``), with R
    ranks, M = max_tokens_per_rank, N tokens of this rank, K = top-k, E_loc = num_experts / R:

    * ``psum_num_recv_tokens_per_rank`` int32 [R]: inclusive prefix sum of tokens received per source rank.
    * ``psum_num_recv_tokens_per_expert`` int32 [E_loc]: non-expand, inclusive prefix sum of the aligned
      counts; expand, ``start[e] + count[e]``.
    * ``num_unaligned_recv_tokens_per_expert`` int32 [E_loc].
    * ``recv_src_metadata`` int32 [R*M, K+2]: ``[:, 0]`` source global id ``src_rank*M + t``, ``[:, 1]``
      ``src_rank*K + master_k``, ``[:, 2+k]`` expand row of top-k position k, or -1.
    * ``dst_row`` int32 [N, R]: row of my token t in rank d's non-expand layout, or -1 (DeepEP's dst slot).
    * ``topk_idx`` int32 [N, K]; ``num_recv_tokens`` int32 []; ``group_sizes`` int32 [E_loc];
      ``recv_topk_idx`` int32 [R*M, K] (non-expand) or None (expand).
    * ``token`` float32 []: orders the next EP op after this dispatch.
    """

    psum_num_recv_tokens_per_rank: jax.Array
    psum_num_recv_tokens_per_expert: jax.Array
    num_unaligned_recv_tokens_per_expert: jax.Array
    recv_src_metadata: jax.Array
    dst_row: jax.Array
    topk_idx: jax.Array
    num_recv_tokens: jax.Array
    group_sizes: jax.Array
    recv_topk_idx: Optional[jax.Array]
    token: jax.Array
    config: _Config

    def replace(self, **changes: Any) -> "EPHandle":
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    # DeepEP-style accessors
    dst_slot = property(lambda self: self.dst_row)
    do_expand = property(lambda self: self.config.expand)
    num_experts = property(lambda self: self.config.num_experts)
    expert_alignment = property(lambda self: self.config.expert_alignment)
    num_max_tokens_per_rank = property(lambda self: self.config.max_tokens_per_rank)
    num_sms = property(lambda self: self.config.num_sms)
    ctx = property(lambda self: self.config.ctx)

    def __repr__(self) -> str:
        c = self.config
        return (f"EPHandle(ranks={c.num_ranks}, num_experts={c.num_experts}, max_tokens_per_rank="
                f"{c.max_tokens_per_rank}, num_tokens={c.num_tokens}, topk={c.topk}, expand={c.expand}, "
                f"expert_alignment={c.expert_alignment})")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                "num_recv_tokens", "group_sizes", "handle", "token"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """What :func:`dispatch` returns (a frozen pytree). Per rank, rows = the receive layout's static row count
    (non-expand ``R*M``, expand :func:`expand_rows`), H hidden, P scale packs, K top-k, E_loc local experts:

    * ``recv_x`` [rows, H] of x's dtype; ``recv_x_scales`` [rows, P] or None (no ``x_scales``).
    * ``recv_topk_idx`` int32 [R*M, K] local expert ids (non-expand; -1 = not on this rank) or None (expand).
    * ``recv_topk_weights`` float32 (non-expand [R*M, K], expand [rows]) or None (no ``topk_weights``).
    * ``num_recv_tokens`` int32 []: real rows (non-expand) / real (token, k) rows (expand).
    * ``group_sizes`` int32 [E_loc]: rows per local expert, alignment included (``jax.lax.ragged_dot``).
    * ``handle``: the :class:`EPHandle` for :func:`combine` and cached dispatch.
    * ``token`` float32 []: orders a later EP op after this one.
    """

    recv_x: jax.Array
    recv_x_scales: Optional[jax.Array]
    recv_topk_idx: Optional[jax.Array]
    recv_topk_weights: Optional[jax.Array]
    num_recv_tokens: jax.Array
    group_sizes: jax.Array
    handle: EPHandle
    token: jax.Array


_LEGACY_COMBINE_UNPACK = ("unpacking a CombineResult as a tuple (`out, w = combine(...)`) is deprecated; use "
                          "`.combined_x` / `.combined_topk_weights` / `.token`")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["combined_x", "combined_topk_weights", "token"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CombineResult:
    """What :func:`combine` returns (a frozen pytree), per rank with N tokens, H hidden, K top-k:

    * ``combined_x`` [N, H] of y's dtype: the reduced expert outputs of every token.
    * ``combined_topk_weights`` float32 [N, K] or None (no ``topk_weights`` passed).
    * ``token`` float32 []: orders a later EP op after this combine.

    Unpacking it as ``(combined_x, combined_topk_weights)`` still works for one release, with a
    DeprecationWarning.
    """

    combined_x: jax.Array
    combined_topk_weights: Optional[jax.Array]
    token: jax.Array

    def __iter__(self):
        warnings.warn(_LEGACY_COMBINE_UNPACK, DeprecationWarning, stacklevel=2)
        return iter((self.combined_x, self.combined_topk_weights))


# ------------------------------------------------------------------------------------------- helpers
def _varying(x, ctx):
    """x marked as varying along the context axis (results get their type from it)."""
    x = jnp.asarray(x)
    t = jax.typeof(x)
    vma = t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma  # jax >= 0.11.2 / older
    if ctx.axis_name not in vma:
        x = jax.lax.pcast(x, ctx.axis_name, to="varying")
    return x


def _vma(x) -> frozenset:
    t = jax.typeof(x)
    return frozenset(t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma)


def _vary_like(a, ref):
    """a marked as varying along every manual axis ref varies along (e.g. a data-parallel axis of a 2-D mesh
    besides the context's): the gradient rules return cotangents typed like the data, so the differentiable
    operands (token, weights, biases) must carry the data's varying axes."""
    extra = _vma(ref) - _vma(a)
    return jax.lax.pcast(a, tuple(sorted(extra)), to="varying") if extra else a


def _ffi_token(token, ctx):
    if token is None:
        return _call.new_token(ctx)
    token = jnp.asarray(token)
    if token.shape != ():
        raise ValueError(f"token must be a scalar (the token returned by a previous jax_engram op), got "
                         f"shape {token.shape}")
    return _varying(token.astype(jnp.float32), ctx)


def _empty(shape, dtype, like):
    return _varying(jnp.zeros(shape, dtype), like)


def _is(dtype, choices) -> bool:
    return any(np.dtype(dtype) == np.dtype(c) for c in choices)


def _dispatch_plan(cfg: _Config, hidden: int, dtype) -> tuple[int, bool]:
    """(copy-engine pieces, graph target) of a dispatch-type call of this config, decided once at trace time: the
    pieces from the native policy (what ``ctx.dispatch_path`` reports; 0 = SM stores), passed to the handler as an
    attribute. The graph targets (dispatch lane 1, ep_layout.h) take the calls of a context with CUDA graphs that move
    rows by SM stores (copy-engine rows need the handler on every call). The region key carries the lane, so a region
    never serves both lanes."""
    ctx = cfg.ctx
    pieces = ctx._copy_pieces(cfg.max_tokens_per_rank, hidden * np.dtype(dtype).itemsize, cfg.topk, cfg.num_experts,
                              cfg.ep)
    return pieces, bool(ctx.cuda_graphs and ctx.platform != "cpu" and pieces == 0)


def _target(base: str, graph: bool) -> str:
    return base + "_graph" if graph else base


def _dispatch_region(cfg: _Config, hidden: int, dtype, num_scales: int, graph: bool = False):
    R, M, K, E = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk, cfg.num_experts
    nbytes = dispatch_staging_bytes(R, M, K, E, hidden * np.dtype(dtype).itemsize, num_scales,
                                    push=cfg.ctx.platform != "cpu")
    key = ("ep_dispatch", R, M, hidden, np.dtype(dtype).name, num_scales, K, E, "lane1" if graph else "lane0")
    return cfg.ctx.region(nbytes, "device", key=key, what="EP dispatch buffer")


def _combine_region(cfg: _Config, hidden: int, dtype):
    R, M, K = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk
    nbytes = combine_staging_bytes(R, M, K, hidden * np.dtype(dtype).itemsize, push=cfg.ctx.platform != "cpu")
    return cfg.ctx.region(nbytes, "device", key=("ep_combine", R, M, hidden, np.dtype(dtype).name, K),
                          what="EP combine buffer")


# ------------------------------------------------------------------------------------------ raw FFI calls
def _dispatch_raw(cfg: _Config, zero_padding: bool, x, w, sf, topk_idx, token):
    ctx = cfg.ctx
    N, H = x.shape
    K, R, E_loc, rows, rt = cfg.topk, cfg.num_ranks, cfg.num_local_experts, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    i32, f32 = jnp.int32, jnp.float32
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),                                         # recv_x
        _call.like(x, (rows, P), sf.dtype),                               # recv_x_scales
        _call.like(x, (0 if cfg.expand else rt, K), i32),                 # recv_topk_idx
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), f32),  # recv_topk_weights
        _call.like(x, (R,), i32),                                         # psum_rank
        _call.like(x, (E_loc,), i32),                                     # psum_expert
        _call.like(x, (E_loc,), i32),                                     # unaligned
        _call.like(x, (rt, K + 2), i32),                                  # recv_src_metadata
        _call.like(x, (N, R), i32),                                       # dst_row
        _call.like(x, (), i32),                                           # num_recv_tokens
        _call.like(x, (E_loc,), i32),                                     # group_sizes
        _call.like(x, (), token.dtype),                                   # token_out
    ]
    return _call.call(ctx, _target("jax_engram_ep_dispatch", graph), results, x, sf, topk_idx, w, token,
                      alloc_id=region.alloc_id, offset=region.offset, **cfg.dispatch_attrs(pieces, zero_padding))


def _cached_raw(cfg: _Config, zero_padding: bool, x, w, sf, meta, psum_rank, psum_expert, unaligned, dst_row,
                token):
    N, H = x.shape
    K, rows, rt = cfg.topk, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),
        _call.like(x, (rows, P), sf.dtype),
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), jnp.float32),
        _call.like(x, (), token.dtype),
    ]
    return _call.call(cfg.ctx, _target("jax_engram_ep_dispatch_cached", graph), results, x, sf, w, meta, psum_rank, psum_expert,
                      unaligned, dst_row, token, alloc_id=region.alloc_id, offset=region.offset,
                      **cfg.dispatch_attrs(pieces, zero_padding))


def _combine_raw(cfg: _Config, y, w, b0, b1, meta, dst_row, topk_idx, psum_rank, token):
    H = y.shape[1]
    N, K = cfg.num_tokens, cfg.topk
    region = _combine_region(cfg, H, y.dtype)
    has_w = w.size != 0
    results = [
        _call.like(y, (N, H)),
        _call.like(y, (N, K if has_w else 0), jnp.float32),
        _call.like(y, (), token.dtype),
    ]
    graph = cfg.ctx.cuda_graphs and cfg.ctx.platform != "cpu"
    return _call.call(cfg.ctx, _target("jax_engram_ep_combine", graph), results, y, w, b0, b1, meta, dst_row, topk_idx, psum_rank,
                      token, alloc_id=region.alloc_id, offset=region.offset, **cfg.combine_attrs())


# --------------------------------------------------------------------------------------------- masks
def _valid_rows(cfg: _Config, num_recv, psum_expert, unaligned):
    """[rows] bool: rows that hold a real (token[, k]) of the layout (not padding, not past the count)."""
    r = jnp.arange(cfg.rows, dtype=jnp.int32)
    if not cfg.expand:
        return r < num_recv
    start = psum_expert - unaligned
    e = jnp.clip(jnp.searchsorted(start, r, side="right") - 1, 0, cfg.num_local_experts - 1)
    return (r >= start[e]) & (r < psum_expert[e])


# ------------------------------------------------------------------------------------------- dispatch vjp
# Operands after the static ones: x, w ([N,K] or [N,0]), sf ([N,P]), routing (tuple of int arrays), token (f32).
# routing = (topk_idx,) for a dispatch, (meta, psum_rank, psum_expert, unaligned, dst_row, topk_idx) cached.
def _dispatch_fwd_impl(cfg, zero_padding, cached, x, w, sf, routing, token):
    tok = token
    if not cached:
        (topk_idx,) = routing
        outs = _dispatch_raw(cfg, zero_padding, x, w, sf, topk_idx, tok)
        recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, gsz, t = outs
        res = (meta, dst_row, topk_idx, psum_rank)
        return (recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, gsz,
                t), res
    meta, psum_rank, psum_expert, unaligned, dst_row, topk_idx = routing
    recv_x, recv_sf, recv_w, t = _cached_raw(cfg, zero_padding, x, w, sf, meta, psum_rank, psum_expert, unaligned,
                                             dst_row, tok)
    return (recv_x, recv_sf, recv_w, t), (meta, dst_row, topk_idx, psum_rank)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _dispatch_p(cfg, zero_padding, cached, x, w, sf, routing, token):
    return _dispatch_fwd_impl(cfg, zero_padding, cached, x, w, sf, routing, token)[0]


def _dispatch_fwd(cfg, zero_padding, cached, x, w, sf, routing, token):
    outs, res = _dispatch_fwd_impl(cfg, zero_padding, cached, x, w, sf, routing, token)
    return outs, (res, x, w, sf, routing, token)


def _float_ct(g, like):
    """Instantiate a (possibly symbolic-zero / float0) cotangent as an array of like's type."""
    if g is None or (hasattr(g, "dtype") and g.dtype == jax.dtypes.float0):
        return jnp.zeros_like(like)
    return g


def _dispatch_bwd(cfg, zero_padding, cached, saved, g):
    (meta, dst_row, topk_idx, psum_rank), x, w, sf, routing, token = saved
    if cached:
        g_x, _, g_w, g_tok = g
    else:
        g_x, _, _, g_w = g[:4]
        g_tok = g[-1]
    g_x = _float_ct(g_x, jnp.zeros((cfg.rows, x.shape[1]), x.dtype))
    g_tok = _float_ct(g_tok, token)
    has_w = w.shape[1] != 0
    y = g_x if _is(g_x.dtype, _COMBINE_DTYPES) else g_x.astype(jnp.float32)
    y = _varying(y, cfg.ctx)
    if has_w:
        wshape = (cfg.rows,) if cfg.expand else (cfg.token_rows, cfg.topk)
        gw = _varying(_float_ct(g_w, jnp.zeros(wshape, jnp.float32)), cfg.ctx)
    else:
        gw = _empty((0,), jnp.float32, cfg.ctx)
    nob = _empty((0, y.shape[1]), y.dtype, cfg.ctx)
    dx, dw, t = _combine_raw(cfg, y, gw, nob, nob, meta, dst_row, topk_idx, psum_rank,
                             _varying(g_tok.astype(jnp.float32), cfg.ctx))
    dx = None if _is(x.dtype, (jnp.float8_e4m3fn,)) else dx.astype(x.dtype)
    dw = dw if has_w else None
    routing_ct = tuple(None for _ in routing)
    tok_ct = jax.lax.convert_element_type(t, token.dtype) + jnp.zeros_like(token)
    return dx, dw, None, routing_ct, tok_ct


_dispatch_p.defvjp(_dispatch_fwd, _dispatch_bwd)


# -------------------------------------------------------------------------------------------- combine vjp
# Operands: y, w (non-expand [R*M,K] / expand [rows] / [0]), biases (tuple of 0-2 [N,H]), handle arrays, token.
def _combine_fwd_impl(cfg, y, w, biases, harr, token):
    meta, dst_row, topk_idx, psum_rank, _, _, _ = harr
    nob = _empty((0, y.shape[1]), y.dtype, cfg.ctx)
    b = list(biases) + [nob] * (2 - len(biases))
    cx, cw, t = _combine_raw(cfg, y, w, b[0], b[1], meta, dst_row, topk_idx, psum_rank, token)
    return cx, cw, t


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_p(cfg, y, w, biases, harr, token):
    return _combine_fwd_impl(cfg, y, w, biases, harr, token)


def _combine_fwd(cfg, y, w, biases, harr, token):
    return _combine_fwd_impl(cfg, y, w, biases, harr, token), (y, w, biases, harr, token)


def _combine_bwd(cfg, saved, g):
    y, w, biases, harr, token = saved
    meta, dst_row, topk_idx, psum_rank, psum_expert, unaligned, recv_topk = harr
    g_x, g_w, g_tok = g
    N, H, K = cfg.num_tokens, y.shape[1], cfg.topk
    g_x = _varying(_float_ct(g_x, jnp.zeros((N, H), y.dtype)), cfg.ctx)
    g_tok = _float_ct(g_tok, token)
    has_w = w.size != 0
    gw = (_varying(_float_ct(g_w, jnp.zeros((N, K), jnp.float32)), cfg.ctx) if has_w
          else _empty((N, 0), jnp.float32, cfg.ctx))
    nosf = _empty((N, 0), jnp.float32, cfg.ctx)
    dy, _, dw, t = _cached_raw(cfg, cfg.expand, g_x, gw, nosf, meta, psum_rank, psum_expert, unaligned, dst_row,
                               _varying(g_tok.astype(jnp.float32), cfg.ctx))
    valid = _valid_rows(cfg, psum_rank[-1], psum_expert, unaligned)
    dy = jnp.where(valid[:, None], dy, jnp.zeros((), dy.dtype))
    if has_w:
        if cfg.expand:
            dw = jnp.where(valid, dw, 0.0)
        else:
            dw = jnp.where(valid[:, None] & (recv_topk >= 0), dw, 0.0)
    else:
        dw = None
    db = tuple(g_x.astype(b.dtype) for b in biases)
    tok_ct = jax.lax.convert_element_type(t, token.dtype) + jnp.zeros_like(token)
    return dy, dw, db, tuple(None for _ in harr), tok_ct


_combine_p.defvjp(_combine_fwd, _combine_bwd)


# ------------------------------------------------------------------------------------------- public API
def _check_int(name, v, lo=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _routing_errors(topk_idx, num_experts: int, ctx):
    """validate_routing=True: a float32 zero that the dispatch's token depends on, computed after every rank's
    topk_idx was checked (on the device) and the first offender of any rank reported to every rank's host: a
    host callback raises there (on every rank) before the dispatch runs, so nothing is sent."""
    N, K = topk_idx.shape
    if N == 0:
        rec = jnp.zeros((4,), topk_idx.dtype)
    else:
        oob = (topk_idx < -1) | (topk_idx >= num_experts)
        srt = jnp.sort(topk_idx, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        oob_tok, dup_tok = jnp.any(oob, axis=1), jnp.any(dup, axis=1)
        t = jnp.argmax(oob_tok | dup_tok)
        v_oob = topk_idx[t, jnp.argmax(oob[t])]
        v_dup = srt[t, 1:][jnp.argmax(dup[t])] if K > 1 else v_oob
        kind = jnp.where(oob_tok[t], 1, jnp.where(dup_tok[t], 2, 0))
        rec = jnp.stack([kind.astype(topk_idx.dtype), t.astype(topk_idx.dtype),
                         jnp.where(kind == 1, v_oob, v_dup), jnp.zeros((), topk_idx.dtype)])
    _call.require_host_callbacks("dispatch(validate_routing=True)")
    everyone = jax.lax.all_gather(rec, ctx.axis_name)  # [R, 4]: kind (0 = fine), token, value
    zero = jax.pure_callback(functools.partial(_raise_routing, num_experts=num_experts),
                             jax.ShapeDtypeStruct((), jnp.float32), everyone, jax.lax.axis_index(ctx.axis_name))
    return jax.lax.stop_gradient(zero)


def _raise_routing(everyone, rank, *, num_experts: int):
    everyone = np.asarray(everyone)
    for r, (kind, t, v, _) in enumerate(everyone.tolist()):
        if kind:
            who = f"rank {r} (this rank)" if r == int(np.asarray(rank)) else f"rank {r}"
            what = (f"holds expert id {v} outside [-1, num_experts={num_experts})" if kind == 1
                    else f"lists expert {v} more than once (duplicate expert ids within a token are illegal)")
            raise JaxEngramError(
                f"jax_engram dispatch (validate_routing=True): topk_idx of {who}, token {t}, {what}. Nothing was "
                "sent and the context is still usable: fix the routing (mask invalid or repeated experts with -1) "
                "and call again")
    return np.zeros((), np.float32)


def dispatch(x: jax.Array, topk_idx: Optional[jax.Array] = None, topk_weights: Optional[jax.Array] = None, *,
             ctx: Context, num_experts: int, max_tokens_per_rank: int, expand: bool = False,
             expert_alignment: int = 1, zero_padding: bool = False, x_scales: Optional[jax.Array] = None,
             handle: Optional[EPHandle] = None, num_sms: Optional[int] = None, token: Optional[jax.Array] = None,
             validate_routing: bool = False, deterministic: Optional[bool] = None,
             config: Optional[EPConfig] = None) -> DispatchResult:
    """Send every token to the ranks owning its top-k experts (inside shard_map over ``ctx``'s axis).

    The order of the received rows is always canonical (source rank, then source token; expand segments by
    source global id), the same run to run (DeepEP's deterministic mode).

    Args:
      x: ``[N, H]`` bf16 / f16 / f32, or float8_e4m3fn with ``x_scales`` ``[N, P]`` (f32 or int32, copied
        verbatim). N <= max_tokens_per_rank.
      topk_idx: ``[N, K]`` int32 (int64 accepted) global expert ids, -1 = none (not sent, not counted).
        A duplicate expert within a token, or an id outside [-1, num_experts), fails the op on every rank.
        Ignored (may be None) with ``handle``.
      topk_weights: ``[N, K]`` float32 or None; routed with the token (non-expand: the whole row;
        expand: the weight of each (token, k) row).
      num_experts: E, a multiple of the ranks R, with E / R <= 256.
      max_tokens_per_rank: M, the static per-rank token bound that sizes every output.
      expand: GEMM-ready per-expert layout (``group_sizes`` feeds ``jax.lax.ragged_dot``).
      expert_alignment: A, per-expert segment alignment (counts are reported aligned to it).
      zero_padding: expand only; zero the alignment padding rows (x, scales, weights).
      handle: replay the layout of a previous dispatch (cached dispatch): same ctx, E, M, expand, A, K, N.
      num_sms: SMs for the CUDA kernels (None/0 = automatic); ignored on CPU.
      token: float32 [] from another jax_engram op, to order this op after it; default: no dependency
        (with ``handle``: the handle's token).
      validate_routing: check ``topk_idx`` on every rank first (ids in [-1, num_experts), no duplicate expert
        within a token): an all-gather of one small record over the axis and a host callback, which raises
        :class:`jax_engram.JaxEngramError` on every rank, naming the rank, token and id, before anything is
        sent; the context stays usable. Without it bad routing fails the dispatch on the device and leaves the
        context unusable (close it and init a new one). Uses an XLA collective over the axis.
      deterministic: deprecated, does nothing (the order is always canonical); passing it warns.
      config: :class:`jax_engram.EPConfig` for this dispatch, the combine that reverses it and their gradients
        (default: the context's ``ep_config``; with ``handle``: the handle's).

    Returns a :class:`DispatchResult` (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
    num_recv_tokens, group_sizes, handle, token).
    """
    if getattr(ctx, "hierarchical", False):  # a (node, local) group: jax_engram._scaleout
        from jax_engram import _scaleout
        if validate_routing and handle is None and topk_idx is not None and jnp.ndim(topk_idx) == 2:
            topk_idx = jnp.asarray(topk_idx)  # the check over the whole (node, local) group, then the dispatch
            t = jax.typeof(topk_idx)
            vma = t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma
            missing = tuple(a for a in ctx.axis_name if a not in vma)
            checked = jax.lax.pcast(topk_idx, missing, to="varying") if missing else topk_idx
            topk_idx = topk_idx + _routing_errors(checked, num_experts, ctx).astype(topk_idx.dtype)
        return _scaleout.dispatch(x, topk_idx, topk_weights, ctx=ctx, num_experts=num_experts,
                                  max_tokens_per_rank=max_tokens_per_rank, expand=expand,
                                  expert_alignment=expert_alignment, zero_padding=zero_padding, x_scales=x_scales,
                                  handle=handle, num_sms=num_sms, token=token,
                                  config=None if config is None else _ep_config(config, "jax_engram.dispatch: config"))
    _call.check_axis(ctx, "dispatch")
    if deterministic is not None:
        warnings.warn("jax_engram.dispatch: `deterministic` is deprecated and does nothing (the receive order is "
                      "always canonical); drop the argument", DeprecationWarning, stacklevel=2)
    R = ctx.num_ranks
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"jax_engram.dispatch: x must be [num_tokens, hidden], got shape {x.shape}")
    if not _is(x.dtype, _X_DTYPES):
        raise TypeError(f"jax_engram.dispatch: x must be bfloat16, float16, float32 or float8_e4m3fn, got {x.dtype}")
    N, H = x.shape
    E = _check_int("num_experts", num_experts, 1)
    M = _check_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    A = _check_int("expert_alignment", expert_alignment, 1)
    sms = 0 if num_sms is None else _check_int("num_sms", num_sms, 0)
    expand, zero_padding = bool(expand), bool(zero_padding)
    epc = None if config is None else _ep_config(config, "jax_engram.dispatch: config")
    if E % R != 0:
        raise ValueError(f"jax_engram.dispatch: num_experts={E} must be a multiple of the {R} ranks of axis "
                         f"{ctx.axis_name!r}")
    if E > MAX_EXPERTS or E // R > MAX_LOCAL_EXPERTS:
        raise ValueError(f"jax_engram.dispatch: num_experts={E} exceeds the limits (E <= {MAX_EXPERTS}, "
                         f"E / ranks <= {MAX_LOCAL_EXPERTS}; got {E // R} per rank)")
    if N > M:
        raise ValueError(f"jax_engram.dispatch: x has {N} tokens but max_tokens_per_rank={M}")
    if zero_padding and not expand:
        raise ValueError("jax_engram.dispatch: zero_padding requires expand=True")
    if ctx.platform != "cpu" and (H * x.dtype.itemsize) % 16 != 0:
        raise ValueError(f"jax_engram.dispatch: hidden * itemsize = {H * x.dtype.itemsize} bytes must be a "
                         "multiple of 16 on GPUs (x rows are moved in 16-byte vectors)")
    if _is(x.dtype, (jnp.float8_e4m3fn,)) and x_scales is None:
        raise ValueError("jax_engram.dispatch: float8_e4m3fn x requires x_scales [N, P] (float32 or int32)")
    if x_scales is not None:
        x_scales = jnp.asarray(x_scales)
        if x_scales.ndim != 2 or x_scales.shape[0] != N:
            raise ValueError(f"jax_engram.dispatch: x_scales must be [N={N}, P], got shape {x_scales.shape}")
        if not _is(x_scales.dtype, _SF_DTYPES):
            raise TypeError(f"jax_engram.dispatch: x_scales must be float32 or int32, got {x_scales.dtype}")
    if handle is not None:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"jax_engram.dispatch: handle must be an EPHandle from a previous dispatch, got "
                            f"{type(handle).__name__}")
        c = handle.config
        mism = [(n, a, b) for n, a, b in (("ctx", c.ctx, ctx), ("num_experts", c.num_experts, E),
                                          ("max_tokens_per_rank", c.max_tokens_per_rank, M),
                                          ("expand", c.expand, expand), ("expert_alignment", c.expert_alignment, A),
                                          ("num_tokens", c.num_tokens, N)) if a is not b and a != b]
        if mism:
            raise ValueError("jax_engram.dispatch: the handle comes from a dispatch with a different "
                             + ", ".join(f"{n} (handle {a!r}, here {b!r})" for n, a, b in mism))
        K = c.topk
        cfg = dataclasses.replace(c, num_sms=sms, ep=c.ep if epc is None else epc)
    else:
        if topk_idx is None:
            raise ValueError("jax_engram.dispatch: topk_idx is required (or pass handle= to replay a layout)")
        topk_idx = jnp.asarray(topk_idx)
        if topk_idx.ndim != 2 or topk_idx.shape[0] != N:
            raise ValueError(f"jax_engram.dispatch: topk_idx must be [N={N}, K], got shape {topk_idx.shape}")
        if not _is(topk_idx.dtype, (jnp.int32, jnp.int64)):
            raise TypeError(f"jax_engram.dispatch: topk_idx must be int32 or int64, got {topk_idx.dtype}")
        K = topk_idx.shape[1]
        if not 1 <= K <= MAX_TOPK:
            raise ValueError(f"jax_engram.dispatch: top-k = {K} must be in [1, {MAX_TOPK}]")
        cfg = _Config(ctx, R, E, M, N, K, expand, A, sms, ctx.ep_config if epc is None else epc)
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        if topk_weights.shape != (N, K):
            raise ValueError(f"jax_engram.dispatch: topk_weights must be [N, K] = {(N, K)}, got "
                             f"{topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise TypeError(f"jax_engram.dispatch: topk_weights must be float32, got {topk_weights.dtype}")

    dispatch_p = _ep_local.dispatch_p if _ep_local.applies(ctx) else _dispatch_p  # one rank: jax_engram/_ep_local.py
    x = _varying(x, ctx)
    w = _varying(topk_weights, ctx) if topk_weights is not None else _empty((N, 0), jnp.float32, ctx)
    sf = _varying(x_scales, ctx) if x_scales is not None else _empty((N, 0), jnp.float32, ctx)
    if token is None and handle is not None:
        token = handle.token
    tok = _vary_like(_ffi_token(token, ctx), x)
    w = _vary_like(w, x)

    if handle is None:
        if validate_routing:
            tok = tok + _routing_errors(_varying(topk_idx, ctx), E, ctx)
        topk_idx = _varying(topk_idx.astype(jnp.int32), ctx)
        outs = dispatch_p(cfg, zero_padding, False, x, w, sf, (topk_idx,), tok)
        recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, gsz, t = outs
        h = EPHandle(psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                     num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=meta, dst_row=dst_row,
                     topk_idx=topk_idx, num_recv_tokens=num_recv, group_sizes=gsz,
                     recv_topk_idx=None if expand else recv_topk, token=t, config=cfg)
        return DispatchResult(recv_x, recv_sf if x_scales is not None else None, None if expand else recv_topk,
                              recv_w if topk_weights is not None else None, num_recv, gsz, h, t)

    h = handle
    routing = (h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, h.psum_num_recv_tokens_per_expert,
               h.num_unaligned_recv_tokens_per_expert, h.dst_row, h.topk_idx)
    recv_x, recv_sf, recv_w, t = dispatch_p(cfg, zero_padding, True, x, w, sf, routing, tok)
    h = h.replace(token=t, config=cfg)
    return DispatchResult(recv_x, recv_sf if x_scales is not None else None, h.recv_topk_idx,
                          recv_w if topk_weights is not None else None, h.num_recv_tokens, h.group_sizes, h, t)


def combine(y: jax.Array, handle: EPHandle, *, topk_weights: Optional[jax.Array] = None,
            bias: jax.Array | tuple[jax.Array, ...] | None = None, token: Optional[jax.Array] = None,
            return_token: Optional[bool] = None) -> CombineResult:
    """Reduce the expert outputs back to their source tokens (inverse of the dispatch that made ``handle``).

    The context is the handle's (``handle.ctx``); call inside shard_map over its axis.

    Args:
      y: the dispatch's receive layout, bfloat16 (float32 accepted, e.g. for gradient checks; CPU only
        where the CUDA build does not support it): non-expand ``[R*M, H]``, expand ``[rows_exp, H]``.
        Only rows of real (token[, k]) entries are read.
      handle: ``DispatchResult.handle`` of that dispatch.
      topk_weights: non-expand ``[R*M, K]`` / expand ``[rows_exp]`` float32, routed back to the source tokens
        (``combined_topk_weights[t, k]`` = the entry of (t, k) on the rank owning expert ``topk_idx[t, k]``,
        0 where ``topk_idx < 0``). Not applied to y: the combine is an unweighted sum.
      bias: None, one ``[N, H]`` array or a tuple of two, of y's dtype; added first (fp32).
      token: float32 []: order after this token instead of the handle's (default: ``handle.token``).
      return_token: deprecated (the token is ``CombineResult.token``); ``True`` returns the old tuple
        ``(combined_x, combined_topk_weights, token)`` with a DeprecationWarning.

    Returns a :class:`CombineResult`: ``combined_x`` [N, H] of y's dtype, ``combined_topk_weights`` [N, K]
    float32 or None, ``token`` float32 [].
    """
    if return_token is not None:
        warnings.warn("jax_engram.combine: `return_token` is deprecated; combine returns a CombineResult whose "
                      "`.token` orders later EP ops", DeprecationWarning, stacklevel=2)
    if not isinstance(handle, EPHandle):
        raise TypeError(f"jax_engram.combine: handle must be the EPHandle of the dispatch it reverses, got "
                        f"{type(handle).__name__}")
    if getattr(handle, "hierarchical", False):  # a (node, local) group: jax_engram._scaleout
        from jax_engram import _scaleout
        cx, cw, t = _scaleout.combine(y, handle, topk_weights=topk_weights, bias=bias, token=token,
                                      return_token=True)
        if return_token:
            return (cx, cw, t)  # type: ignore[return-value]
        return CombineResult(cx, cw, t)
    cfg = handle.config
    ctx = cfg.ctx
    _call.check_axis(ctx, "combine")
    y = jnp.asarray(y)
    if y.ndim != 2 or y.shape[0] != cfg.rows:
        raise ValueError(f"jax_engram.combine: y must be [{cfg.rows}, hidden] (the {'expand' if cfg.expand else 'non-expand'} "
                         f"receive layout of the handle's dispatch), got shape {y.shape}")
    if not _is(y.dtype, _COMBINE_DTYPES):
        raise TypeError(f"jax_engram.combine: y must be bfloat16 (or float32), got {y.dtype}")
    N, H, K = cfg.num_tokens, y.shape[1], cfg.topk
    if ctx.platform != "cpu" and (H * y.dtype.itemsize) % 16 != 0:
        raise ValueError(f"jax_engram.combine: hidden * itemsize = {H * y.dtype.itemsize} bytes must be a multiple "
                         "of 16 on GPUs")
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        want = (cfg.rows,) if cfg.expand else (cfg.token_rows, K)
        if topk_weights.shape != want:
            raise ValueError(f"jax_engram.combine: topk_weights must be {list(want)} for expand={cfg.expand}, got "
                             f"shape {topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise TypeError(f"jax_engram.combine: topk_weights must be float32, got {topk_weights.dtype}")
        w = _varying(topk_weights, ctx)
    else:
        w = _empty((0,), jnp.float32, ctx)
    if bias is None:
        biases = ()
    elif isinstance(bias, (tuple, list)):
        biases = tuple(bias)
    else:
        biases = (bias,)
    if len(biases) > 2:
        raise ValueError(f"jax_engram.combine: at most two bias arrays, got {len(biases)}")
    checked = []
    for i, b in enumerate(biases):
        b = jnp.asarray(b)
        if b.shape != (N, H):
            raise ValueError(f"jax_engram.combine: bias[{i}] must be [N, H] = {(N, H)}, got shape {b.shape}")
        if b.dtype != y.dtype:
            raise TypeError(f"jax_engram.combine: bias[{i}] must have y's dtype {y.dtype}, got {b.dtype}")
        checked.append(_varying(b, ctx))
    h = handle
    harr = (h.recv_src_metadata, h.dst_row, h.topk_idx, h.psum_num_recv_tokens_per_rank,
            h.psum_num_recv_tokens_per_expert, h.num_unaligned_recv_tokens_per_expert,
            h.recv_topk_idx if h.recv_topk_idx is not None else _empty((0, K), jnp.int32, ctx))
    y = _varying(y, ctx)
    tok = _vary_like(_ffi_token(h.token if token is None else token, ctx), y)
    w = _vary_like(w, y)
    combine_p = _ep_local.combine_p if _ep_local.applies(ctx) else _combine_p  # one rank: jax_engram/_ep_local.py
    cx, cw, t = combine_p(cfg, y, w, tuple(_vary_like(b, y) for b in checked), harr, tok)
    res = CombineResult(cx, cw if topk_weights is not None else None, t)
    if return_token:
        return (res.combined_x, res.combined_topk_weights, res.token)  # type: ignore[return-value]
    return res
