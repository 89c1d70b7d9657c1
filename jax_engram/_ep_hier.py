"""The hierarchical EP path: dispatch / combine over a ("node", "gpu") context
(:class:`~jax_engram.context.HierContext`), a sibling of :mod:`jax_engram._ep_flat` and :mod:`jax_engram._ep_local`
built on them: everything that crosses nodes runs on XLA collectives over the node axes inside the caller's jitted
program (``jax.lax.all_to_all`` with static capacity; same-rail forwarding: rank (node a, local j) exchanges only with
(node b, local j)); everything inside a node runs on the EP ops of the context's per-node inner context (the path
:func:`jax_engram._ep_local.path` picks for it: the flat one, or the one-rank path where a node has one rank).
Results are bit-identical to the flat path over the same global ranks. Takes the validated arguments of
:mod:`jax_engram._ep_args`; the gradients are the shared rules of :mod:`jax_engram._ep_autodiff`.

EP dispatch (``dispatch``): one copy of a token per destination node (``all_to_all`` over the node axis,
capacity N tokens per node), then the intra-node dispatch on the receiving (forwarding) rank. To keep
combine bit-exact the forwarding rank splits every forwarded token into one intra-node token per
destination rank of its node (at most ``S = min(K, local_size)``), so the intra-node combine never adds two
ranks' rows: one partial row per (token, destination rank) travels back across nodes and the source folds
them in the flat order (fp32, ascending master top-k position, bias first). A per-node reduce would send one
row per (token, node) instead but round differently; exactness costs S times the combine's inter-node bytes
and S times the intra-node staging on the forwarding rank. The intra-node op's receive order (forwarding rank,
source node, token) is permuted on device into the flat order (source rank, token) with gathers built from
``recv_src_metadata``.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp

from jax_engram import _ep_autodiff, _ep_local
from jax_engram._ep_args import (CombineArgs, DispatchArgs, combine_args, dispatch_args, routing_errors, routing_guard,
                                 routing_records)
from jax_engram._ep_types import HANDLE_FIELDS, CombineResult, DispatchResult, EPHandle, expand_rows

__all__ = ["HierEPHandle", "Geometry", "dispatch", "combine"]

_HIER_HANDLE_FIELDS = ("inner", "tok_src", "row_src", "inner_tok_flat", "inner_row_flat")


# ---------------------------------------------------------------------------------------------------- EP
@functools.partial(jax.tree_util.register_dataclass, data_fields=[*HANDLE_FIELDS, *_HIER_HANDLE_FIELDS],
                   meta_fields=["config"])
@dataclasses.dataclass(frozen=True, repr=False)
class HierEPHandle(EPHandle):
    """The EPHandle of a dispatch over a :class:`~jax_engram.context.HierContext`. The flat fields hold the
    flat-path values over the global ranks (``dst_row`` included); ``inner`` is the intra-node dispatch's handle
    and the other extra arrays map rows between the intra-node layout and the flat one."""

    inner: Any = None
    tok_src: Any = None
    row_src: Any = None
    inner_tok_flat: Any = None
    inner_row_flat: Any = None

    @classmethod
    def build(cls, config, **arrays):
        """A handle from the arrays it has (the flat fields it does not have are None)."""
        return cls(config=config, **{f: arrays.get(f) for f in (*HANDLE_FIELDS, *_HIER_HANDLE_FIELDS)})


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The shape of a hierarchical dispatch. Every forwarded token is split on the forwarding rank into
    ``copies_per_token`` intra-node tokens (one per destination rank of its node), so the intra-node dispatch
    sees at most ``inner_max_tokens = num_nodes * num_tokens * copies_per_token`` tokens per rank."""

    num_nodes: int
    num_scaleup_ranks: int  # ranks per node (the local axis)
    num_ranks: int
    topk: int
    num_tokens: int
    max_tokens_per_rank: int
    copies_per_token: int  # min(topk, num_scaleup_ranks)
    num_local_experts: int
    inner_max_tokens: int

    @property
    def inner_num_experts(self) -> int:
        """The experts of one node (the intra-node dispatch's num_experts)."""
        return self.num_scaleup_ranks * self.num_local_experts


def _geometry(cfg) -> Geometry:
    ctx = cfg.ctx
    copies = min(cfg.topk, ctx.local_size)
    return Geometry(num_nodes=ctx.num_nodes, num_scaleup_ranks=ctx.local_size, num_ranks=ctx.num_ranks,
                    topk=cfg.topk, num_tokens=cfg.num_tokens, max_tokens_per_rank=cfg.max_tokens_per_rank,
                    copies_per_token=copies, num_local_experts=cfg.num_local_experts,
                    inner_max_tokens=ctx.num_nodes * cfg.num_tokens * copies)


def _routing(cfg, topk):
    """Per top-k entry: valid, owner global rank, owner node, owner local rank (masked entries: -1 / 0)."""
    E, E_loc, L = cfg.num_experts, cfg.num_local_experts, cfg.ctx.local_size
    valid = (topk >= 0) & (topk < E)
    orank = jnp.where(valid, topk // E_loc, -1)
    onode = jnp.where(valid, orank // L, -1)
    oloc = jnp.where(valid, orank % L, -1)
    return valid, orank, onode, oloc


def _slots(valid, onode, oloc, node, L, S):
    """For tokens [..., K] and a node: hit[..., i] (rank i of that node holds one of the token's experts),
    slot_k[..., k] (slot of entry k's rank among the token's hit ranks of that node, ascending rank), and
    rank_of_slot[..., s] (-1 when the token has fewer hit ranks)."""
    li = jnp.where(valid & (onode == node), oloc, -1)
    hit = jnp.any(li[..., :, None] == jnp.arange(L, dtype=jnp.int32), axis=-2)           # [..., L]
    slot_of = jnp.cumsum(hit.astype(jnp.int32), axis=-1) - 1
    slot_k = jnp.take_along_axis(slot_of, jnp.maximum(li, 0), axis=-1)
    slot_k = jnp.where(li >= 0, slot_k, -1)
    ranks = jnp.arange(L, dtype=jnp.int32)
    sel = hit[..., None, :] & (slot_of[..., None, :] == jnp.arange(S, dtype=jnp.int32)[:, None])  # [..., S, L]
    rank_of_slot = jnp.max(jnp.where(sel, ranks, -1), axis=-1)
    return li, slot_k, rank_of_slot


def _forward(ctx, a):
    """[N, ...] -> [num_nodes, N, ...]: this rank's tokens to the same-rail rank of every node (static capacity N
    per node); returns, per source node a, the tokens of (a, my local index)."""
    return ctx.node_all_to_all(jnp.broadcast_to(a[None], (ctx.num_nodes,) + a.shape))


def _inner_tokens(cfg, fwd_topk):
    """On the forwarding rank: the intra-node routing of the forwarded tokens [Nn, N, K] (global expert ids),
    split into one intra-node token per destination rank of this node: [Nn*N*S, K] node-local expert ids."""
    ctx = cfg.ctx
    g = _geometry(cfg)
    K, S, node_experts = g.topk, g.copies_per_token, g.inner_num_experts
    node = ctx.node_index()
    valid, orank, onode, oloc = _routing(cfg, fwd_topk)
    li, _, rank_of_slot = _slots(valid, onode, oloc, node, g.num_scaleup_ranks, S)   # [Nn,N,K], [Nn,N,S]
    mine = (li[..., None, :] == rank_of_slot[..., :, None]) & (rank_of_slot[..., :, None] >= 0)  # [Nn,N,S,K]
    itopk = jnp.where(mine, (fwd_topk - node * node_experts)[..., None, :], -1)
    # Routing the flat op refuses must fail on every node, as the same kind of error: a token whose first bad entry
    # (in k order, as the op checks) is an id outside [-1, num_experts) carries an out-of-range node-local id to
    # every node's intra-node dispatch, one whose first bad entry repeats an expert carries node-local expert 0
    # twice.
    E = cfg.num_experts
    in_range = (fwd_topk >= 0) & (fwd_topk < E)
    earlier = jnp.arange(K)[None, :] < jnp.arange(K)[:, None]                                  # [k, j]: j < k
    dup = in_range & jnp.any((fwd_topk[..., :, None] == fwd_topk[..., None, :]) & earlier & in_range[..., None, :],
                             axis=-1)
    bad_k = (fwd_topk >= E) | (fwd_topk < -1) | dup
    bad = jnp.any(bad_k, axis=-1)
    first_dup = jnp.take_along_axis(dup, jnp.argmax(bad_k, axis=-1)[..., None], axis=-1)[..., 0]
    s0 = jnp.arange(S)[:, None] == 0
    as_range = jnp.where(s0 & (jnp.arange(K)[None, :] == 0), node_experts, -1)               # [S, K]
    as_dup = jnp.where(s0 & (jnp.arange(K)[None, :] < 2), 0, -1)
    forced = jnp.where(first_dup[..., None, None], as_dup, as_range)
    itopk = jnp.where(bad[..., None, None], forced, itopk)
    return itopk.reshape(g.inner_max_tokens, K).astype(jnp.int32)


def _split(a, S):
    """[Nn, N, ...] forwarded rows -> [Nn*N*S, ...] (one copy per intra-node token)."""
    return jnp.broadcast_to(a[:, :, None], a.shape[:2] + (S,) + a.shape[2:]).reshape((-1,) + a.shape[2:])


def _maps(cfg, inner):
    """Row maps between the intra-node receive layout (rows ordered by forwarding rank, source node, token) and
    the flat one (source rank, token), from the inner handle; plus the flat handle fields."""
    g = _geometry(cfg)
    num_scaleup_ranks, num_ranks, topk = g.num_scaleup_ranks, g.num_ranks, g.topk
    num_tokens, max_tokens_per_rank, copies_per_token = g.num_tokens, g.max_tokens_per_rank, g.copies_per_token
    num_local_experts, inner_max_tokens = g.num_local_experts, g.inner_max_tokens
    flat_tokens = num_ranks * max_tokens_per_rank          # token rows of the flat layout; also "no flat row"
    i32 = jnp.int32
    meta = inner.recv_src_metadata                          # [num_scaleup_ranks * inner_max_tokens, topk + 2]
    num_inner_rows = meta.shape[0]
    num_recv = inner.num_recv_tokens
    inner_real = jnp.arange(num_inner_rows, dtype=i32) < num_recv
    # an inner row's source: inner global id = forwarding rank * inner_max_tokens + intra-node token, the token
    # being (source node * num_tokens + source token) * copies_per_token + copy; the forwarding rank (same rail) has
    # the source rank's local index
    inner_gid = jnp.maximum(meta[:, 0], 0)
    fwd_rank, inner_token = inner_gid // inner_max_tokens, inner_gid % inner_max_tokens
    src_node = inner_token // (num_tokens * copies_per_token)
    src_token = (inner_token // copies_per_token) % num_tokens
    src_rank = src_node * num_scaleup_ranks + fwd_rank
    src_gid = jnp.where(inner_real, src_rank * max_tokens_per_rank + src_token, flat_tokens)  # flat global id
    present = jnp.zeros((flat_tokens + 1,), i32).at[src_gid].set(1)[:flat_tokens]
    flat_pos = jnp.cumsum(present) - 1
    inner_tok_flat = jnp.where(inner_real, flat_pos[jnp.minimum(src_gid, flat_tokens - 1)], flat_tokens)  # flat row
    tok_src = jnp.zeros((flat_tokens,), i32).at[inner_tok_flat].set(jnp.arange(num_inner_rows, dtype=i32),
                                                                     mode="drop")
    recv_per_rank = jnp.zeros((num_ranks + 1,), i32).at[jnp.where(inner_real, src_rank, num_ranks)].add(1)[:num_ranks]
    psum_rank = jnp.cumsum(recv_per_rank).astype(i32)
    flat_token_meta = meta[tok_src]                         # the inner metadata of every flat token row
    flat_meta_k = flat_token_meta[:, 2:]
    row_src = inner_row_flat = None
    if cfg.expand:
        flat_rows = cfg.rows
        inner_rows = expand_rows(num_scaleup_ranks, inner_max_tokens, topk, num_local_experts, cfg.expert_alignment)
        inner_unaligned = inner.num_unaligned_recv_tokens_per_expert
        inner_start = inner.psum_num_recv_tokens_per_expert - inner_unaligned     # segment start per local expert
        inner_row = meta[:, 2:]                             # the inner expand row of (inner token row, k)
        has_row = (inner_row >= 0) & inner_real[:, None]
        expert = jnp.clip(jnp.searchsorted(inner_start, inner_row, side="right") - 1, 0, num_local_experts - 1)
        # the flat expand order: by local expert, then flat source global id
        no_key = num_local_experts * flat_tokens
        key = jnp.where(has_row, expert * flat_tokens + src_gid[:, None], no_key).reshape(-1)
        order = jnp.argsort(key, stable=True)
        sorted_pos = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype)).reshape(
            inner_row.shape)
        expert_first = jnp.cumsum(inner_unaligned) - inner_unaligned                # expert's first sorted position
        flat_row = jnp.where(has_row, inner_start[expert] + sorted_pos - expert_first[expert], -1).astype(i32)
        row_src = jnp.arange(flat_rows, dtype=i32).at[jnp.where(has_row, flat_row, flat_rows)].set(inner_row,
                                                                                                mode="drop")
        row_src = jnp.minimum(row_src, inner_rows - 1)
        inner_row_flat = jnp.zeros((inner_rows,), i32).at[jnp.where(has_row, inner_row, inner_rows)].set(
            flat_row, mode="drop")
        flat_meta_k = flat_row[tok_src]
    flat_real = jnp.arange(flat_tokens, dtype=i32) < num_recv
    gid_col = jnp.where(flat_real, src_gid[tok_src], -1)
    master_col = jnp.where(flat_real, src_rank[tok_src] * topk + flat_token_meta[:, 1] % topk, -1)
    flat_meta = jnp.concatenate([gid_col[:, None], master_col[:, None], jnp.where(flat_real[:, None], flat_meta_k, -1)],
                                axis=1).astype(i32)
    return dict(tok_src=tok_src, row_src=row_src, inner_tok_flat=inner_tok_flat, inner_row_flat=inner_row_flat,
                recv_src_metadata=flat_meta, psum_num_recv_tokens_per_rank=psum_rank)


def _dst_row(cfg, topk):
    """dst_row [N, R]: row of each of my tokens in every rank's flat non-expand layout (the exclusive prefix of
    the lower ranks' counts comes from a small all_gather of per-rank counts)."""
    ctx = cfg.ctx
    R = ctx.num_ranks
    valid, orank, _, _ = _routing(cfg, topk)
    hits = jnp.any(orank[:, :, None] == jnp.arange(R, dtype=jnp.int32), axis=1)       # [N, R]
    h = hits.astype(jnp.int32)
    allc = jax.lax.all_gather(ctx.varying(jnp.sum(h, axis=0)), ctx.axis_name)        # [R src, R dst]
    me = ctx.node_index() * ctx.local_size + ctx.local_index()
    base = jnp.sum(jnp.where(jnp.arange(R)[:, None] < me, allc, 0), axis=0)
    return jnp.where(hits, base[None] + jnp.cumsum(h, axis=0) - h, -1).astype(jnp.int32)


def _flat_rows(cfg, h, a, token_layout: bool):
    """Gather an intra-node receive array into the flat layout (token rows or expand rows)."""
    idx = h.tok_src if (token_layout or not cfg.expand) else h.row_src
    return a[idx]


def _inner_args(cfg, g: Geometry, zero_padding, x, topk_idx, w, sf, handle, token) -> DispatchArgs:
    """The intra-node dispatch of the forwarded (split) tokens, over the node's inner context."""
    return dispatch_args(x, topk_idx, w, ctx=cfg.ctx.inner, num_experts=g.inner_num_experts,
                         max_tokens_per_rank=g.inner_max_tokens, expand=cfg.expand,
                         expert_alignment=cfg.expert_alignment, zero_padding=zero_padding, x_scales=sf, handle=handle,
                         num_sms=cfg.num_sms or None, token=token, validate_routing=False, config=cfg.ep)


def _intra_node(args):
    """The path of an intra-node op (``args`` over the inner context): the flat or the one-rank path."""
    return _ep_local.path(args.config)


def _intra_node_dispatch(args: DispatchArgs) -> DispatchResult:
    return _intra_node(args).dispatch(args)


def _forward_split(ctx, g: Geometry, a):
    """This rank's rows to every node, one copy per intra-node token: [N, ...] -> [Nn*N*S, ...] (None stays)."""
    return None if a is None else _split(_forward(ctx, a), g.copies_per_token)


# --------------------------------------------------------------------- the path (see jax_engram._ep_autodiff)
def dispatch_impl(cfg, zero_padding, x, w, sf, topk, token):
    """(recv_x, recv_sf, recv_w, handle) of a hierarchical dispatch."""
    ctx = cfg.ctx
    g = _geometry(cfg)
    forwarded_topk = _forward(ctx, topk)
    res = _intra_node_dispatch(_inner_args(cfg, g, zero_padding, _forward_split(ctx, g, x),
                                           _inner_tokens(cfg, forwarded_topk), _forward_split(ctx, g, w),
                                           _forward_split(ctx, g, sf), None, token))
    inner = res.handle
    maps = _maps(cfg, inner)
    h = HierEPHandle.build(cfg, inner=inner, dst_row=_dst_row(cfg, topk), topk_idx=topk,
                           psum_num_recv_tokens_per_expert=inner.psum_num_recv_tokens_per_expert,
                           num_unaligned_recv_tokens_per_expert=inner.num_unaligned_recv_tokens_per_expert,
                           num_recv_tokens=inner.num_recv_tokens, group_sizes=inner.group_sizes, done=res.done,
                           recv_topk_idx=None if cfg.expand else res.recv_topk_idx[maps["tok_src"]], **maps)
    recv_x = _flat_rows(cfg, h, res.recv_x, False)
    recv_sf = None if sf is None else _flat_rows(cfg, h, res.recv_x_scales, False)
    recv_w = None if w is None else _flat_rows(cfg, h, res.recv_topk_weights, False)
    return recv_x, recv_sf, recv_w, h


def cached_impl(cfg, zero_padding, x, w, sf, h, token):
    """(recv_x, recv_sf, recv_w, token) of a hierarchical cached dispatch through the handle h."""
    ctx = cfg.ctx
    g = _geometry(cfg)
    res = _intra_node_dispatch(_inner_args(cfg, g, zero_padding, _forward_split(ctx, g, x), None,
                                           _forward_split(ctx, g, w), _forward_split(ctx, g, sf), h.inner, token))
    recv_x = _flat_rows(cfg, h, res.recv_x, False)
    recv_sf = None if sf is None else _flat_rows(cfg, h, res.recv_x_scales, False)
    recv_w = None if w is None else _flat_rows(cfg, h, res.recv_topk_weights, False)
    return recv_x, recv_sf, recv_w, res.done


def combine_impl(cfg, y, w, biases, h, token):
    """Exact hierarchical combine: intra-node combine of one-rank tokens (no sums across ranks), one row per
    (token, destination rank) back to the source node, then the flat fold (fp32, bias first, ascending master
    top-k position)."""
    ctx = cfg.ctx
    g = _geometry(cfg)
    num_nodes, topk, num_tokens, copies = g.num_nodes, g.topk, g.num_tokens, g.copies_per_token
    inner_rows = h.inner_row_flat if cfg.expand else h.inner_tok_flat
    inner_y = y[jnp.minimum(inner_rows, y.shape[0] - 1)]
    inner_w = None if w is None else w[jnp.minimum(inner_rows, w.shape[0] - 1)]
    inner_args = combine_args(inner_y, h.inner, topk_weights=inner_w, bias=None, token=token)
    r = _intra_node(inner_args).combine(inner_args)
    cx, cw, t = r.combined_x, r.combined_topk_weights, r.done
    back = ctx.node_all_to_all(cx.reshape(num_nodes, num_tokens, copies, -1))  # [Nn (dest node), N, S, H]
    topk_idx = h.topk_idx
    valid, orank, onode, oloc = _routing(cfg, topk_idx)
    # slot of entry k's rank within its node (the forwarding rank numbered them the same way)
    slot_k = jnp.zeros(topk_idx.shape, jnp.int32)
    for n in range(num_nodes):
        _, sk, _ = _slots(valid, onode, oloc, n, g.num_scaleup_ranks, copies)
        slot_k = jnp.where(onode == n, sk, slot_k)
    later_same = (orank[:, :, None] == orank[:, None, :]) & valid[:, None, :] & \
        (jnp.arange(topk)[None, None, :] > jnp.arange(topk)[None, :, None])
    is_master = valid & ~jnp.any(later_same, axis=-1)                        # [N, K]
    tidx = jnp.arange(num_tokens)[:, None]
    rows = back[jnp.maximum(onode, 0), tidx, jnp.maximum(slot_k, 0)]         # [N, K, H]
    f32 = jnp.float32
    acc = jnp.full((num_tokens, y.shape[1]), -0.0, f32)
    for b in biases:
        acc = acc + b.astype(f32)
    for k in range(topk):
        acc = acc + jnp.where(is_master[:, k, None], rows[:, k].astype(f32), jnp.array(-0.0, f32))
    has_term = jnp.any(valid, axis=-1) if not biases else jnp.ones((num_tokens,), bool)
    out = jnp.where(has_term[:, None], acc, 0.0)
    if y.dtype == jnp.bfloat16:
        # An explicit rounding: XLA may drop a convert pair f32 -> bf16 -> f32 when the caller's f32 math on the
        # result fuses with it ("excess precision"); the flat op's result comes out of a custom call, rounded.
        out = jax.lax.reduce_precision(out, exponent_bits=8, mantissa_bits=7)
    out = out.astype(y.dtype)
    out_w = None
    if w is not None:
        bw = ctx.node_all_to_all(cw.reshape(num_nodes, num_tokens, copies, topk))
        kk = jnp.arange(topk)[None, :]
        out_w = jnp.where(valid, bw[jnp.maximum(onode, 0), tidx, jnp.maximum(slot_k, 0), kk], 0.0).astype(f32)
    return out, out_w, t


# ---------------------------------------------------------------------------------------------- routing
def _report_routing(topk_idx, num_experts: int, ctx, tok):
    """Bad routing on a ("node", "gpu") group, in the group's global numbers: every rank's first bad entry is
    gathered over the group (``routing_records``) and every rank's guard (on the inner context) records the first
    offender as the flat dispatch kernel does, so the call fails on every rank naming the same global rank, token
    and id, and the context is then unusable as after the flat op's refusal. Where any rank's routing is bad, every
    rank forwards none (all -1): the intra-node ops run on valid routing and nobody waits.
    Returns (topk_idx to forward, tok after the guard)."""
    zero, checked = routing_guard(routing_records(topk_idx, num_experts, ctx), num_experts, ctx, ctx.inner,
                                  refuse=False)
    return jnp.where(jnp.any(checked[:-1, 0] != 0), -1, topk_idx), tok + jax.lax.stop_gradient(zero)


# ------------------------------------------------------------------------------------------- entry points
def dispatch(args: DispatchArgs) -> DispatchResult:
    """``jax_engram.dispatch`` over a :class:`~jax_engram.context.HierContext` (same arguments and results as the
    flat op)."""
    cfg = args.config
    vary = cfg.ctx.varying
    path = sys.modules[__name__]
    x = vary(args.x)
    w = None if args.topk_weights is None else vary(args.topk_weights)
    sf = None if args.x_scales is None else vary(args.x_scales)
    tok = vary(jnp.zeros((), jnp.float32) if args.token is None else args.token.astype(jnp.float32))
    if not args.cached:
        topk_idx = args.topk_idx
        if args.validate_routing:  # the check over the whole group refuses the call, then the dispatch
            tok = tok + routing_errors(topk_idx, cfg.num_experts, cfg.ctx, cfg.ctx.inner)
        else:
            topk_idx, tok = _report_routing(topk_idx, cfg.num_experts, cfg.ctx, tok)
        recv_x, recv_sf, recv_w, h = _ep_autodiff.dispatch_op(path, cfg, args.zero_padding, x, w, sf,
                                                              vary(topk_idx.astype(jnp.int32)), tok)
    else:
        recv_x, recv_sf, recv_w, t = _ep_autodiff.cached_dispatch_op(path, cfg, args.zero_padding, x, w, sf,
                                                                     args.handle, tok)
        h = args.handle.replace(done=t, config=cfg)
    return DispatchResult(recv_x, recv_sf, None if cfg.expand else h.recv_topk_idx, recv_w, h.num_recv_tokens,
                          h.group_sizes, h, h.done)


def combine(args: CombineArgs) -> CombineResult:
    """``jax_engram.combine`` of a hierarchical dispatch (same arguments and results as the flat op)."""
    cfg = args.config
    vary = cfg.ctx.varying
    w = None if args.topk_weights is None else vary(args.topk_weights)
    biases = tuple(vary(b) for b in args.biases)
    tok = vary(args.token.astype(jnp.float32))
    cx, cw, t = _ep_autodiff.combine_op(sys.modules[__name__], cfg, vary(args.y), w, biases, args.handle, tok)
    return CombineResult(cx, cw, t)
