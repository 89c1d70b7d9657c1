"""Hierarchical (node, local) groups, Engram: one jax_engram context spanning several NVLink domains / hosts.

``jax_engram.init(mesh, ("node", "gpu"))`` returns a :class:`~jax_engram.context.HierContext`. The EP group is
the tuple of mesh axes; global EP rank = ``node_index * local_size + local_index`` (the order
``P(("node", "gpu"))`` lays out). It holds one flat :class:`~jax_engram.context.Context` over the last ("gpu")
axis: one group per node, so a member maps the windows of its own node's ranks only. Everything that crosses
nodes runs on XLA collectives over the node axes inside the caller's jitted program (``jax.lax.all_to_all``
with static capacity; same-rail forwarding: rank (node a, local j) exchanges only with (node b, local j));
everything inside a node runs on the flat ops of the inner context. Results are bit-identical to the flat path
over the same global ranks.

Engram (:class:`HierEngram`, the backend of an ``EngramTable`` over such a context): ids are bucketed by owner
node; bucket b goes to the same-rail rank of node b (``all_to_all``, capacity T*E ids per node), which reads
the rows from its node's windows (inner lookup, node-local ids) and sends them back the same way; the
requester selects, per id, the row from its owner node. Every rank's inner table holds its node's slice of the
replicated scale-factor table, so scale factors travel with the rows. The bucketing is :func:`engram_buckets`.
Where NCCL reports GIN on every node
(:mod:`jax_engram._scaleout_gin`; compiled against NCCL >= 2.30.4; not exercised by any test: no machine we test on has a GIN-capable NIC) the inter-node
leg is a GIN fetch instead: the inner lookup reads this node's bucket, and the ``jax_engram_engram_gin_fetch``
custom call reads every other row from its owner's window (requests grouped as the buckets,
``engram_gin_plan.h``); no ``all_to_all``. Results, modes, padding and status are those of the collective path.

The EP ops of such a context: :mod:`jax_engram._ep_hier`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_engram import _call, _ffi, _scaleout_gin

__all__ = ["HierEngram", "engram_buckets"]

_ENGRAM_MODES = dict(_ffi.native("cpu").engram_layout["modes"])  # engram_layout.h Mode (jax_engram.ENGRAM_MODES)
_NO_BAD_POSITION = int(_ffi.native("cpu").engram_layout["no_bad_position"])  # engram_layout.h kNoBadPosition


# ------------------------------------------------------------------------------------------------- Engram
class HierEngram:
    """The hierarchical backend of an :class:`~jax_engram.EngramTable` over a
    :class:`~jax_engram.context.HierContext` (see the module docstring for the path). ``inner`` is a flat table
    over the node's inner context: this rank's shard, read by the ranks of its node; the public table checks
    the arguments and hands the work here."""

    def __init__(self, ctx, inner):
        self.ctx = ctx
        self.inner = inner
        self.num_entries, self.hidden, self.row_bytes = inner.num_entries, inner.hidden, inner.row_bytes
        self.num_sf_packs = inner.num_sf_packs
        self.region, self.sf_region = inner.region, inner.sf_region  # what _scaleout_gin registers
        self.total_entries = ctx.num_ranks * self.num_entries
        self.node_entries = ctx.local_size * self.num_entries
        self._gin, self._gin_reason = None, ctx._gin_reason
        if ctx.inter_node_path == "gin":
            self._gin, self._gin_reason = _scaleout_gin.register_table(self)

    @property
    def inter_node_path(self) -> str:
        return "gin" if self._gin is not None else "xla all_to_all"

    def write(self, storage, sf, row_offset, *, after=None):
        """EngramTable.write on a ("node", "gpu") group; the arguments were checked by the table (``row_offset``:
        int32 [])."""
        if self.num_sf_packs:
            # This node's rows of the written slices (rank-major, local_size ranks per node): the inner table serves
            # them with the data rows.
            n = self.ctx.local_size * storage.shape[0]
            sf = jax.lax.dynamic_slice_in_dim(sf, self.ctx.node_index() * n, n)
        if self._gin is None:
            return self.inner.write(storage, sf, row_offset=row_offset, after=after)
        # GIN reads other nodes' windows directly: the write waits until every rank's earlier lookups (its
        # ``after``) are done, and its ``done`` until every rank's write is.
        ax = self.ctx.axis_name
        if after is not None:
            after = jax.lax.psum(self.ctx.varying(jnp.asarray(after, jnp.float32).reshape(-1)[:1].sum()), ax)
        tok = self.inner.write(storage, sf, row_offset=row_offset, after=after)
        return jax.lax.psum(self.ctx.varying(tok), ax)

    def fetch(self, indices, token, mode: str, sf_layout: str, config):
        """(data, sf, status) of the whole lookup (inter-node exchange, inner reads, exchange back); the
        public ``wait`` only hands them over (``overlap`` has no effect on this path; the inner reads are
        lookups, with ``config``'s lookup_gather)."""
        return _engram_fetch(self, indices, token, mode, sf_layout, config)

    def ids_sharded(self, ids) -> bool:
        """lookup_global's default: ids are sharded when their first dimension is split over every axis of
        the group."""
        spec = ids.sharding.spec if isinstance(ids, jax.Array) and isinstance(ids.sharding, NamedSharding) else ()
        first = spec[0] if len(spec) else None
        first = first if isinstance(first, tuple) else (first,)
        return all(a in first for a in self.ctx.axis_name)

    def replicated_lookup_fn(self, table, mode, sf_layout, config):
        """The jitted lookup of replicated ids [T, I] (every rank looks up the same rows) for lookup_global."""
        ax = self.ctx.axis_name

        def body(ids, tok):
            data, sf = table.wait(table.fetch(ids, after=tok, mode=mode, sf_layout=sf_layout, config=config))
            sf = sf if sf is not None else jnp.zeros((0,), jnp.int32)
            return data, sf, (tok + jnp.zeros((1,), tok.dtype) * data.reshape(-1)[:1].size)

        # Replicated ids: every rank computes the same rows, but the inter-node exchange makes them "varying"
        # for shard_map's type check; the replicated outputs are stated, not inferred.
        return jax.jit(jax.shard_map(body, mesh=self.ctx.mesh, in_specs=(P(), P(ax)), out_specs=(P(), P(), P(ax)),
                                     check_vma=False))

    def free(self) -> None:
        _scaleout_gin.release_table(self)
        self.inner.free()
        self.region = self.sf_region = None


def engram_buckets(ids, total: int, per_node: int, num_nodes: int, mode: str):
    """The collective path's request accounting (the GIN plan of engram_gin_plan.h groups the same way; tests
    hold the two equal). ids [...] int32 global ids -> (valid [...], owner node or -1 [...], buckets
    [num_nodes, ...]): bucket b holds the node-local id (local * num_entries + row) of every id owned by node b
    at its flat position, -1 elsewhere (capacity: every position)."""
    g = jnp.minimum(ids, total - 1) if mode == "clip" else ids
    valid = (g >= 0) & (g < total)
    owner = jnp.where(valid, g // per_node, -1)
    nodes = jnp.arange(num_nodes, dtype=jnp.int32).reshape((num_nodes,) + (1,) * ids.ndim)
    buckets = jnp.where(owner[None] == nodes, g[None] - nodes * per_node, -1)
    return valid, owner, buckets


def _engram_fetch(table, ids, token, mode, sf_layout, config=None):
    """ids [T, E] int32 global ids -> (data [T, E*hidden], sf per sf_layout, status)."""
    ctx = table.ctx
    T, E = ids.shape
    H, Pk, Nn = table.hidden, table.num_sf_packs, ctx.num_nodes
    total, per_node = table.total_entries, table.node_entries
    ids = ctx.varying(ids)
    valid, owner, buckets = engram_buckets(ids, total, per_node, Nn, mode)
    if table._gin is not None:
        out, s = _gin_leg(table, ids, buckets, token, mode, config)
    else:
        req = ctx.node_all_to_all(buckets)                                       # [Nn, T, E] from node a
        inner_tok = req if token is None else token
        data, sf = table.inner.lookup(req.reshape(Nn * T, E), after=inner_tok, mode="fill", sf_layout="row",
                                      config=config)
        rows = ctx.node_all_to_all(data.reshape(Nn, T, E, H))                    # [Nn, T, E, H] from node b
        sel = jnp.clip(owner, 0, Nn - 1)[None, :, :, None]
        out = jnp.take_along_axis(rows, sel, axis=0)[0]
        out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype)).reshape(T, E * H)
        s = None
        if Pk:
            sfr = ctx.node_all_to_all(sf.reshape(Nn, T, E, Pk))
            s = jnp.take_along_axis(sfr, sel, axis=0)[0]
            s = jnp.where(valid[..., None], s, jnp.zeros((), s.dtype)).reshape(T, E * Pk)
    sf_out = jnp.zeros((0,), jnp.int32)
    if Pk:
        if sf_layout == "tma_col_major":
            Tp = (T + 3) // 4 * 4
            s = jnp.pad(s.T, ((0, 0), (0, Tp - T)))
        sf_out = s
    status = jnp.zeros((), jnp.int32)
    if mode == "checked":
        out, status = _checked(table, ids, total, out)
    return out, sf_out, status


def _gin_leg(table, ids, buckets, token, mode, config):
    """The GIN inter-node leg: this node's bucket through the intra-node lookup (other ids read zero rows), then
    the GIN fetch of every row owned by another node into the same rows (and scale factors alike)."""
    ctx, g = table.ctx, table._gin
    T, E = ids.shape
    Pk = table.num_sf_packs
    mine = jax.lax.dynamic_index_in_dim(buckets, ctx.node_index(), axis=0, keepdims=False)   # [T, E]
    data, sf = table.inner.lookup(mine, after=mine if token is None else token, mode="fill", sf_layout="row",
                                  config=config)
    mode_i = _ENGRAM_MODES[mode]
    out = _scaleout_gin.fetch(ctx, ids, data, window=g.window, region_offset=g.offset,
                              num_entries=table.num_entries, row_bytes=table.row_bytes, local_stride=0, mode=mode_i)
    s = None
    if Pk:
        # Every rank of a node holds the node's scale factors (row local*num_entries + row of the owner's shard).
        s = _scaleout_gin.fetch(ctx, ids, sf.reshape(T, E * Pk), window=g.sf_window, region_offset=g.sf_offset,
                                num_entries=table.num_entries, row_bytes=Pk * 4,
                                local_stride=table.num_entries * Pk * 4, mode=mode_i)
    return out, s


def _checked(table, ids, total, out):
    """mode='checked': fail the call (the native check of the flat path's checked wait, the same OUT_OF_RANGE
    message) naming this rank's first out-of-range flat position and its id. It reads ``out``, so it runs after
    every collective of the lookup and no peer waits on this rank. Returns (out, status): the position or
    kNoBadPosition."""
    ctx = table.ctx
    flat = ids.reshape(-1)
    bad = flat >= total
    pos = jnp.where(jnp.any(bad), jnp.argmax(bad).astype(jnp.int32), jnp.int32(_NO_BAD_POSITION))
    rank = (ctx.node_index() * ctx.local_size + ctx.local_index()).astype(jnp.int32)
    word = jnp.stack([pos, rank])  # EngramWaitAttrs: the position, then the rank the message names
    empty = jnp.zeros((0,), jnp.int32)
    out, _ = _call.call(ctx.inner, "jax_engram_engram_wait", [_call.like(out), _call.like(empty)], out, empty, word,
                        ids, word, input_output_aliases={0: 0, 1: 1}, keep=True, overlap=0, slot=0,
                        check_total=total)
    return out, pos
