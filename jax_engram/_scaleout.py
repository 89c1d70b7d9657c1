"""Hierarchical (node, local) EP groups: one jax_engram context spanning several NVLink domains / hosts.

``jax_engram.init(mesh, ("node", "gpu"))`` returns a :class:`HierContext`. The EP group is the tuple of mesh
axes; global EP rank = ``node_index * local_size + local_index`` (the order ``P(("node", "gpu"))`` lays out).
It holds one flat :class:`~jax_engram.context.Context` over the last ("gpu") axis: one group per node, so a
member maps the windows of its own node's ranks only. Everything that crosses nodes runs on XLA collectives
over the node axes inside the caller's jitted program (``jax.lax.all_to_all`` with static capacity; same-rail
forwarding: rank (node a, local j) exchanges only with (node b, local j)); everything inside a node runs on
the flat ops of the inner context. Results are bit-identical to the flat path over the same global ranks.

Engram (``_HierEngramTable``): ids are bucketed by owner node; bucket b goes to the same-rail rank of node b
(``all_to_all``, capacity T*E ids per node), which reads the rows from its node's windows (inner lookup,
node-local ids) and sends them back the same way; the requester selects, per id, the row from its owner
node. Every rank's inner table holds its node's slice of the replicated scale-factor table, so scale
factors travel with the rows. The bucketing is :func:`engram_buckets`. Where NCCL reports GIN on every node
(:mod:`jax_engram._scaleout_gin`; compiled against NCCL >= 2.30.4, never run on hardware here) the inter-node
leg is a GIN fetch instead: the inner lookup reads this node's bucket, and the ``jax_engram_engram_gin_fetch``
custom call reads every other row from its owner's window (requests grouped as the buckets,
``engram_gin_plan.h``); no ``all_to_all``. Results, modes, padding and status are those of the collective path.

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
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HierContext"]


# ------------------------------------------------------------------------------------------------ context
class HierContext:
    """A jax_engram context over a tuple of mesh axes ``(node axes..., local axis)``. Create with
    ``jax_engram.init(mesh, ("node", "gpu"))``. Ops run inside ``jax.shard_map`` over all of these axes
    (``P(("node", "gpu"))``); the signatures of every op are those of the flat path."""

    hierarchical = True

    def __init__(self, mesh, axes: tuple, *, device_bytes, host_bytes, timeout_s: float, cuda_graphs: bool = False,
                 ep_config=None):
        from jax_engram.context import Context

        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"jax_engram.init: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        axes = tuple(axes)
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"jax_engram.init: the EP group {axes!r} must be distinct mesh axis names")
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(f"jax_engram.init: axis {a!r} of the EP group {axes!r} is not an axis of the mesh "
                                 f"{mesh.axis_names}")
        self.mesh = mesh
        self.axis_name = axes
        self.node_axes = axes[:-1]
        self.local_axis = axes[-1]
        self.num_nodes = int(math.prod(mesh.shape[a] for a in self.node_axes))
        self.local_size = int(mesh.shape[self.local_axis])
        self.num_ranks = self.num_nodes * self.local_size
        self.inner = Context(mesh, self.local_axis, device_bytes=device_bytes, host_bytes=host_bytes,
                             timeout_s=timeout_s, cuda_graphs=cuda_graphs, ep_config=ep_config)
        self.ep_config = self.inner.ep_config  # the intra-node dispatches' tuning
        self.platform = self.inner.platform
        self.timeout_s = self.inner.timeout_s
        self.cuda_graphs = self.inner.cuda_graphs
        self.id = self.inner.id
        self.device_bytes, self.host_bytes = self.inner.device_bytes, self.inner.host_bytes
        from jax_engram import _scaleout_gin

        self._inter_node_path, self._gin_reason = _scaleout_gin.probe(self)

    # The node axis as jax.lax collectives take it (a name or a tuple of names).
    @property
    def node_axis(self):
        return self.node_axes[0] if len(self.node_axes) == 1 else self.node_axes

    @property
    def inter_node_path(self) -> str:
        """How Engram rows cross nodes: "gin" or "xla all_to_all" (static capacity, same-rail); see
        :mod:`jax_engram._scaleout_gin`."""
        return self._inter_node_path

    def _check_open(self) -> None:
        self.inner._check_open()

    @property
    def _closed(self) -> bool:
        return self.inner._closed

    def check(self) -> None:
        self.inner.check()

    def errors(self) -> list[dict]:
        return self.inner.errors()

    def graph_captures(self) -> dict:
        return self.inner.graph_captures()

    def dispatch_path(self, **kw) -> str:
        """How the intra-node leg of ``dispatch`` moves rows (see ``Context.dispatch_path``)."""
        return self.inner.dispatch_path(**kw)

    def region(self, *a, **k):
        raise NotImplementedError("jax_engram: a hierarchical (node, local) context has no symmetric memory of its "
                                  "own; Engram tables and EP buffers live in its per-node inner context "
                                  "(ctx.inner); barrier / ring_exchange need a flat context")

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "HierContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HierContext(axes={self.axis_name!r}, nodes={self.num_nodes}, ranks_per_node={self.local_size}, "
                f"ranks={self.num_ranks}, platform={self.platform}, inner={self.inner!r})")

    def info(self) -> dict:
        d = dict(self.inner.info())
        d.update({"axis": self.axis_name, "num_ranks": self.num_ranks, "hierarchical": True,
                  "nodes": self.num_nodes, "ranks_per_node": self.local_size, "node_axes": self.node_axes,
                  "local_axis": self.local_axis, "inter_node_path": self.inter_node_path,
                  "intra_node_path": "jax_engram windows (shared memory)" if self.platform == "cpu"
                  else "jax_engram windows (NVLink)",
                  "gin": "in use" if self._inter_node_path == "gin" else f"not used: {self._gin_reason}",
                  "inner": {"id": self.inner.id, "groups": len(self.inner._groups)}})
        return d

    # ------------------------------------------------------------------------------------- in shard_map
    def node_index(self):
        return jax.lax.axis_index(self.node_axis).astype(jnp.int32)

    def local_index(self):
        return jax.lax.axis_index(self.local_axis).astype(jnp.int32)

    def varying(self, x):
        """x marked as varying along every axis of the group (collectives over the node axes need it)."""
        x = jnp.asarray(x)
        t = jax.typeof(x)
        vma = t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma
        missing = tuple(a for a in self.axis_name if a not in vma)
        if missing:
            x = jax.lax.pcast(x, missing, to="varying")
        return x

    def node_all_to_all(self, x):
        """x [num_nodes, ...]: block b goes to the same-rail rank of node b; returns [num_nodes, ...] with block a
        from node a. Payloads travel as unsigned integers of their width (bit-exact for every dtype)."""
        x = self.varying(x)
        if self.num_nodes == 1:
            return x
        dt = x.dtype
        u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dt).itemsize]
        xu = jax.lax.bitcast_convert_type(x, u) if dt != u else x
        yu = jax.lax.all_to_all(xu, self.node_axis, 0, 0, tiled=True)
        return jax.lax.bitcast_convert_type(yu, dt) if dt != u else yu


# ------------------------------------------------------------------------------------------------- Engram
def _engram_table_class():
    from jax_engram.engram import EngramTable, EngramPending

    class _HierEngramTable(EngramTable):
        """EngramTable over a :class:`HierContext` (same API; the path: the ``jax_engram._scaleout`` docstring)."""

        def __init__(self, num_entries: int, hidden: int, dtype=jnp.bfloat16, *, ctx, placement: str = "host",
                     num_sf_packs: int = 0, sf_dtype=np.float32, sf_placement: str = "device", config=None):
            inner = EngramTable(num_entries, hidden, dtype, ctx=ctx.inner, placement=placement,
                                num_sf_packs=num_sf_packs, sf_dtype=sf_dtype, sf_placement=sf_placement,
                                config=config)
            self.inner = inner
            self.ctx = ctx
            for k in ("num_entries", "hidden", "dtype", "placement", "num_sf_packs", "sf_dtype", "sf_placement",
                      "row_bytes", "nbytes", "_uid", "region", "sf_region", "config"):
                setattr(self, k, getattr(inner, k))
            self.num_ranks = ctx.num_ranks
            self.total_entries = self.num_ranks * self.num_entries
            self.node_entries = ctx.local_size * self.num_entries
            if self.total_entries > 2**31 - 1:
                inner.free()
                raise ValueError(f"jax_engram.EngramTable: num_ranks*num_entries = {self.total_entries} exceeds "
                                 "2**31-1; global ids are int32")
            self.sf_nbytes = self.total_entries * self.num_sf_packs * 4
            self._token = None
            self._global_fns = {}
            self._gin, self._gin_reason = None, ctx._gin_reason
            if ctx.inter_node_path == "gin":
                from jax_engram import _scaleout_gin

                try:
                    self._gin, self._gin_reason = _scaleout_gin.register_table(self)
                except BaseException:
                    inner.free()
                    raise

        @property
        def inter_node_path(self) -> str:
            """How this table's rows cross nodes: "gin" or "xla all_to_all" (see ctx.info()["gin"])."""
            return "gin" if self._gin is not None else "xla all_to_all"

        def __repr__(self) -> str:
            return f"Hierarchical{super().__repr__()} ({self.ctx.num_nodes} nodes x {self.ctx.local_size})"

        def write(self, storage, sf=None, *, token=None):
            from jax_engram import _call

            _call.check_axis(self.ctx, "EngramTable.write")
            if self.num_sf_packs and sf is None:
                raise ValueError(f"jax_engram EngramTable.write: the table has num_sf_packs={self.num_sf_packs}: "
                                 f"pass sf, the replicated scale-factor table [num_ranks*num_entries, P] = "
                                 f"[{self.total_entries}, {self.num_sf_packs}]")
            if self.num_sf_packs:
                sf = jnp.asarray(sf)
                if sf.shape != (self.total_entries, self.num_sf_packs):
                    raise ValueError(f"jax_engram EngramTable.write: sf must be the replicated table [num_ranks*"
                                     f"num_entries, num_sf_packs] = [{self.total_entries}, {self.num_sf_packs}] "
                                     f"indexed by global id, got {sf.shape}")
                # This node's rows of the replicated table: the inner table serves them with the data rows.
                sf = jax.lax.dynamic_slice_in_dim(sf, self.ctx.node_index() * self.node_entries, self.node_entries)
            if self._gin is None:
                return self.inner.write(storage, sf, token=token)
            # GIN reads other nodes' windows directly: the write waits until every rank's earlier lookups (the
            # token) are done, and its token until every rank's write is.
            ax = self.ctx.axis_name
            if token is not None:
                token = jax.lax.psum(self.ctx.varying(jnp.asarray(token, jnp.float32).reshape(-1)[:1].sum()), ax)
            tok = self.inner.write(storage, sf, token=token)
            return jax.lax.psum(self.ctx.varying(tok), ax)

        def fetch(self, indices, token=None, *, mode: str = "fill", sf_layout: str = "row",
                  overlap: bool = True, config=None) -> EngramPending:
            """As the flat fetch; the whole path (inter-node exchange, inner reads, exchange back) runs here and
            ``wait`` only hands the result over (``overlap`` has no effect on this path; the inner reads are
            lookups, with ``config``'s lookup_gather)."""
            from jax_engram import _call
            from jax_engram.engram import ENGRAM_MODES, SF_LAYOUTS, _check_choice

            _call.check_axis(self.ctx, "EngramTable.fetch")
            _check_choice("mode", mode, ENGRAM_MODES)
            _check_choice("sf_layout", sf_layout, SF_LAYOUTS)
            indices = self._indices(indices, "fetch")
            T, E = indices.shape
            sf_dt = self.sf_dtype if self.num_sf_packs else np.dtype(np.int32)
            status = jnp.zeros((), jnp.int32)
            if T * E == 0:
                return EngramPending(jnp.zeros((T, E * self.hidden), self.dtype),
                                     jnp.zeros(self.sf_shape(T, E, sf_layout), sf_dt), status, indices,
                                     bool(self.num_sf_packs), False)
            data, sf, status = _engram_fetch(self, indices, token, mode, sf_layout, config)
            return EngramPending(data, sf, status, indices, bool(self.num_sf_packs), False)

        def wait(self, pending: EngramPending, *, after=None):
            """As the flat wait; the rows are ready when ``fetch`` returns on this path, so ``after`` (ordering
            only) has nothing to order here."""
            from jax_engram import _call

            _call.check_axis(self.ctx, "EngramTable.wait")
            if not isinstance(pending, EngramPending):
                raise TypeError(f"jax_engram EngramTable.wait: expected the EngramPending returned by fetch, got "
                                f"{type(pending).__name__}")
            return pending.data, (pending.sf if pending.has_sf else None)

        def lookup_global(self, ids, *, mode: str = "fill", sf_layout: str = "row", sharded: bool | None = None,
                          config=None):
            if sharded is None:
                from jax.sharding import NamedSharding

                spec = ids.sharding.spec if isinstance(ids, jax.Array) and isinstance(ids.sharding,
                                                                                       NamedSharding) else ()
                first = spec[0] if len(spec) else None
                first = first if isinstance(first, tuple) else (first,)
                sharded = all(a in first for a in self.ctx.axis_name)
            return super().lookup_global(ids, mode=mode, sf_layout=sf_layout, sharded=sharded, config=config)

        def _lookup_fn(self, mode, sf_layout, sharded, config=None):
            config = config or self.config
            if sharded:
                return super()._lookup_fn(mode, sf_layout, sharded, config)
            key = ("lookup", mode, sf_layout, sharded, config)
            fn = self._global_fns.get(key)
            if fn is None:
                from jax.sharding import PartitionSpec as P

                ax = self.ctx.axis_name

                def body(ids, tok):
                    data, sf = self.wait(self.fetch(ids, tok, mode=mode, sf_layout=sf_layout, config=config))
                    sf = sf if sf is not None else jnp.zeros((0,), jnp.int32)
                    return data, sf, (tok + jnp.zeros((1,), tok.dtype) * data.reshape(-1)[:1].size)

                # Replicated ids: every rank computes the same rows, but the inter-node exchange makes them
                # "varying" for shard_map's type check; the replicated outputs are stated, not inferred.
                fn = jax.jit(jax.shard_map(body, mesh=self.ctx.mesh, in_specs=(P(), P(ax)),
                                           out_specs=(P(), P(), P(ax)), check_vma=False))
                self._global_fns[key] = fn
            return fn

        def free(self) -> None:
            from jax_engram import _scaleout_gin

            _scaleout_gin.release_table(self)
            self.inner.free()
            self.region = self.sf_region = None

    return _HierEngramTable


@functools.lru_cache(maxsize=None)
def hier_engram_table_class():
    return _engram_table_class()


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
        data, sf = table.inner.lookup(req.reshape(Nn * T, E), inner_tok, mode="fill", sf_layout="row",
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
        status = _checked(ctx, ids, total, out)
    return out, sf_out, status


def _gin_leg(table, ids, buckets, token, mode, config):
    """The GIN inter-node leg: this node's bucket through the intra-node lookup (other ids read zero rows), then
    the GIN fetch of every row owned by another node into the same rows (and scale factors alike)."""
    from jax_engram import _scaleout_gin
    from jax_engram.engram import ENGRAM_MODES

    ctx, g = table.ctx, table._gin
    T, E = ids.shape
    Pk = table.num_sf_packs
    mine = jax.lax.dynamic_index_in_dim(buckets, ctx.node_index(), axis=0, keepdims=False)   # [T, E]
    data, sf = table.inner.lookup(mine, mine if token is None else token, mode="fill", sf_layout="row",
                                  config=config)
    mode_i = ENGRAM_MODES[mode]
    out = _scaleout_gin.fetch(ctx, ids, data, window=g.window, region_offset=g.offset,
                              num_entries=table.num_entries, row_bytes=table.row_bytes, local_stride=0, mode=mode_i)
    s = None
    if Pk:
        # Every rank of a node holds the node's scale factors (row local*num_entries + row of the owner's shard).
        s = _scaleout_gin.fetch(ctx, ids, sf.reshape(T, E * Pk), window=g.sf_window, region_offset=g.sf_offset,
                                num_entries=table.num_entries, row_bytes=Pk * 4,
                                local_stride=table.num_entries * Pk * 4, mode=mode_i)
    return out, s


def _checked(ctx, ids, total, after):
    """mode='checked': raise (host callback, after every collective of the lookup, so no peer waits on this
    rank) naming the first out-of-range flat position and its id; status is that position or 0x7F7F7F7F."""
    T, E = ids.shape
    flat = ids.reshape(-1)
    bad = flat >= total
    pos = jnp.argmax(bad).astype(jnp.int32)
    any_bad = jnp.any(bad)
    rank = ctx.node_index() * ctx.local_size + ctx.local_index()
    dep = jax.lax.bitcast_convert_type(after.reshape(-1)[:1], jnp.uint8).reshape(-1)[:1].astype(jnp.int32)

    def cb(any_bad, pos, gid, rank, dep):
        if bool(any_bad):
            pos, gid = int(pos), int(gid)
            raise IndexError(
                f"jax_engram EngramTable.fetch: index out of range in mode='checked': id {gid} at flat position "
                f"{pos} (token {pos // E}, entry {pos % E}) on rank {int(rank)} is not in [0, {total}) = "
                "[0, num_ranks*num_entries)")
        return np.int32(0x7F7F7F7F)

    from jax.experimental import io_callback

    from jax_engram import _call

    _call.require_host_callbacks("EngramTable.fetch (mode='checked')")
    st = io_callback(cb, jax.ShapeDtypeStruct((), jnp.int32), any_bad, pos, flat[pos], rank, dep[0])
    return jnp.where(any_bad, pos, st)


# ---------------------------------------------------------------------------------------------------- EP
def _ep():
    from jax_engram import ep

    return ep


@functools.lru_cache(maxsize=None)
def _handle_class():
    ep = _ep()
    base_fields = ep._HANDLE_FIELDS
    extra = ("inner", "tok_src", "row_src", "inner_tok_flat", "inner_row_flat")

    @functools.partial(jax.tree_util.register_dataclass, data_fields=[*base_fields, *extra], meta_fields=["config"])
    @dataclasses.dataclass(frozen=True, repr=False)
    class HierEPHandle(ep.EPHandle):
        """The EPHandle of a dispatch over a :class:`HierContext`. The flat fields hold the flat-path values
        over the global ranks (``dst_row`` included); ``inner`` is the intra-node dispatch's handle and the
        other extra arrays map rows between the intra-node layout and the flat one."""

        inner: Any = None
        tok_src: Any = None
        row_src: Any = None
        inner_tok_flat: Any = None
        inner_row_flat: Any = None

        hierarchical = True
        EXTRA = extra

        @classmethod
        def build(cls, config, **arrays):
            """A handle from the arrays it has (the flat fields it does not have are None)."""
            return cls(config=config, **{f: arrays.get(f) for f in (*base_fields, *extra)})

    return HierEPHandle


def _geometry(cfg):
    ctx = cfg.ctx
    Nn, L, R = ctx.num_nodes, ctx.local_size, ctx.num_ranks
    K, N, M = cfg.topk, cfg.num_tokens, cfg.max_tokens_per_rank
    S = min(K, L)
    return Nn, L, R, K, N, M, S, cfg.num_local_experts, Nn * N * S


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


def _forward(ctx, a, Nn):
    """[N, ...] -> [Nn, N, ...]: this rank's tokens to the same-rail rank of every node (static capacity N per
    node) ; returns, per source node a, the tokens of (a, my local index)."""
    return ctx.node_all_to_all(jnp.broadcast_to(a[None], (Nn,) + a.shape))


def _inner_tokens(cfg, fwd_topk):
    """On the forwarding rank: the intra-node routing of the forwarded tokens [Nn, N, K] (global expert ids),
    split into one intra-node token per destination rank of this node: [Nn*N*S, K] node-local expert ids."""
    ctx = cfg.ctx
    Nn, L, R, K, N, M, S, E_loc, Mi = _geometry(cfg)
    b = ctx.node_index()
    valid, orank, onode, oloc = _routing(cfg, fwd_topk)
    li, _, rank_of_slot = _slots(valid, onode, oloc, b, L, S)                 # [Nn,N,K], [Nn,N,S]
    mine = (li[..., None, :] == rank_of_slot[..., :, None]) & (rank_of_slot[..., :, None] >= 0)  # [Nn,N,S,K]
    itopk = jnp.where(mine, (fwd_topk - b * (L * E_loc))[..., None, :], -1)
    # Routing the flat op refuses (an id >= num_experts, a duplicate expert) must fail on every node: such a
    # token carries an invalid node-local id to every node's intra-node dispatch.
    srt = jnp.sort(jnp.where(fwd_topk >= 0, fwd_topk, -1 - jnp.arange(K, dtype=jnp.int32)), axis=-1)
    bad = jnp.any(fwd_topk >= cfg.num_experts, axis=-1) | jnp.any(srt[..., 1:] == srt[..., :-1], axis=-1)
    first = (jnp.arange(S)[:, None] == 0) & (jnp.arange(K)[None, :] == 0)
    itopk = jnp.where(bad[..., None, None], jnp.where(first, L * E_loc, -1), itopk)
    return itopk.reshape(Nn * N * S, K).astype(jnp.int32)


def _split(a, S):
    """[Nn, N, ...] forwarded rows -> [Nn*N*S, ...] (one copy per intra-node token)."""
    return jnp.broadcast_to(a[:, :, None], a.shape[:2] + (S,) + a.shape[2:]).reshape((-1,) + a.shape[2:])


def _maps(cfg, inner):
    """Row maps between the intra-node receive layout (rows ordered by forwarding rank, source node, token) and
    the flat one (source rank, token), from the inner handle; plus the flat handle fields."""
    ctx = cfg.ctx
    Nn, L, R, K, N, M, S, E_loc, Mi = _geometry(cfg)
    i32 = jnp.int32
    meta = inner.recv_src_metadata                                          # [L*Mi, K+2]
    RT = meta.shape[0]
    num_recv = inner.num_recv_tokens
    rvalid = jnp.arange(RT, dtype=i32) < num_recv
    ig = jnp.maximum(meta[:, 0], 0)
    jj, tt = ig // Mi, ig % Mi
    a, t = tt // (N * S), (tt // S) % N
    fsrc = a * L + jj
    fg = jnp.where(rvalid, fsrc * M + t, R * M)
    present = jnp.zeros((R * M + 1,), i32).at[fg].set(1)[:R * M]
    pos = jnp.cumsum(present) - 1
    inner_tok_flat = jnp.where(rvalid, pos[jnp.minimum(fg, R * M - 1)], R * M)   # flat token row of inner row
    tok_src = jnp.zeros((R * M,), i32).at[inner_tok_flat].set(jnp.arange(RT, dtype=i32), mode="drop")
    counts = jnp.zeros((R + 1,), i32).at[jnp.where(rvalid, fsrc, R)].add(1)[:R]
    psum_rank = jnp.cumsum(counts).astype(i32)
    mk = meta[tok_src]
    flat_meta_k = mk[:, 2:]
    row_src = inner_row_flat = None
    if cfg.expand:
        rows_f, rows_i = cfg.rows, _ep().expand_rows(L, Mi, K, E_loc, cfg.expert_alignment)
        starts = inner.psum_num_recv_tokens_per_expert - inner.num_unaligned_recv_tokens_per_expert
        unal = inner.num_unaligned_recv_tokens_per_expert
        q = meta[:, 2:]
        qv = (q >= 0) & rvalid[:, None]
        e = jnp.clip(jnp.searchsorted(starts, q, side="right") - 1, 0, E_loc - 1)
        big = E_loc * R * M
        key = jnp.where(qv, e * (R * M) + fg[:, None], big).reshape(-1)
        order = jnp.argsort(key, stable=True)
        p = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype)).reshape(q.shape)
        excl = jnp.cumsum(unal) - unal
        flat_q = jnp.where(qv, starts[e] + p - excl[e], -1).astype(i32)           # flat expand row of (row, k)
        row_src = jnp.arange(rows_f, dtype=i32).at[jnp.where(qv, flat_q, rows_f)].set(q, mode="drop")
        row_src = jnp.minimum(row_src, rows_i - 1)
        inner_row_flat = jnp.zeros((rows_i,), i32).at[jnp.where(qv, q, rows_i)].set(flat_q, mode="drop")
        flat_meta_k = flat_q[tok_src]
    fvalid = jnp.arange(R * M, dtype=i32) < num_recv
    col0 = jnp.where(fvalid, fg[tok_src], -1)
    col1 = jnp.where(fvalid, fsrc[tok_src] * K + mk[:, 1] % K, -1)
    flat_meta = jnp.concatenate([col0[:, None], col1[:, None], jnp.where(fvalid[:, None], flat_meta_k, -1)],
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


def _dispatch_impl(cfg, zero_padding, x, w, sf, topk, token):
    ep = _ep()
    ctx = cfg.ctx
    Nn, L, R, K, N, M, S, E_loc, Mi = _geometry(cfg)
    fx, ftopk = _forward(ctx, x, Nn), _forward(ctx, topk, Nn)
    itopk = _inner_tokens(cfg, ftopk)
    iw = None if w is None else _split(_forward(ctx, w, Nn), S)
    isf = None if sf is None else _split(_forward(ctx, sf, Nn), S)
    res = ep.dispatch(_split(fx, S), itopk, iw, ctx=ctx.inner, num_experts=L * E_loc, max_tokens_per_rank=Mi,
                      expand=cfg.expand, expert_alignment=cfg.expert_alignment, zero_padding=zero_padding,
                      x_scales=isf, num_sms=cfg.num_sms or None, token=token, config=cfg.ep)
    inner = res.handle
    maps = _maps(cfg, inner)
    Hc = _handle_class()
    h = Hc.build(cfg, inner=inner, dst_row=_dst_row(cfg, topk), topk_idx=topk,
           psum_num_recv_tokens_per_expert=inner.psum_num_recv_tokens_per_expert,
           num_unaligned_recv_tokens_per_expert=inner.num_unaligned_recv_tokens_per_expert,
           num_recv_tokens=inner.num_recv_tokens, group_sizes=inner.group_sizes, token=res.token,
           recv_topk_idx=None if cfg.expand else res.recv_topk_idx[maps["tok_src"]], **maps)
    recv_x = _flat_rows(cfg, h, res.recv_x, False)
    recv_sf = None if sf is None else _flat_rows(cfg, h, res.recv_x_scales, False)
    recv_w = None if w is None else _flat_rows(cfg, h, res.recv_topk_weights, False)
    return recv_x, recv_sf, recv_w, h


def _cached_impl(cfg, zero_padding, x, w, sf, h, token):
    ep = _ep()
    ctx = cfg.ctx
    Nn, L, R, K, N, M, S, E_loc, Mi = _geometry(cfg)
    ix = _split(_forward(ctx, x, Nn), S)
    iw = None if w is None else _split(_forward(ctx, w, Nn), S)
    isf = None if sf is None else _split(_forward(ctx, sf, Nn), S)
    res = ep.dispatch(ix, None, iw, ctx=ctx.inner, num_experts=L * E_loc, max_tokens_per_rank=Mi,
                      expand=cfg.expand, expert_alignment=cfg.expert_alignment, zero_padding=zero_padding,
                      x_scales=isf, handle=h.inner, num_sms=cfg.num_sms or None, token=token, config=cfg.ep)
    recv_x = _flat_rows(cfg, h, res.recv_x, False)
    recv_sf = None if sf is None else _flat_rows(cfg, h, res.recv_x_scales, False)
    recv_w = None if w is None else _flat_rows(cfg, h, res.recv_topk_weights, False)
    return recv_x, recv_sf, recv_w, res.token


def _combine_impl(cfg, y, w, biases, h, token):
    """Exact hierarchical combine: intra-node combine of one-rank tokens (no sums across ranks), one row per
    (token, destination rank) back to the source node, then the flat fold (fp32, bias first, ascending master
    top-k position)."""
    ep = _ep()
    ctx = cfg.ctx
    Nn, L, R, K, N, M, S, E_loc, Mi = _geometry(cfg)
    imap = h.inner_row_flat if cfg.expand else h.inner_tok_flat
    yi = y[jnp.minimum(imap, y.shape[0] - 1)]
    wi = None if w is None else w[jnp.minimum(imap, w.shape[0] - 1)]
    r = ep.combine(yi, h.inner, topk_weights=wi, token=token)
    cx, cw, t = r.combined_x, r.combined_topk_weights, r.token
    back = ctx.node_all_to_all(cx.reshape(Nn, N, S, -1))                     # [Nn (dest node), N, S, H]
    topk = h.topk_idx
    valid, orank, onode, oloc = _routing(cfg, topk)
    # slot of entry k's rank within its node (the forwarding rank numbered them the same way)
    slot_k = jnp.zeros(topk.shape, jnp.int32)
    for n in range(Nn):
        _, sk, _ = _slots(valid, onode, oloc, n, L, S)
        slot_k = jnp.where(onode == n, sk, slot_k)
    later_same = (orank[:, :, None] == orank[:, None, :]) & valid[:, None, :] & \
        (jnp.arange(K)[None, None, :] > jnp.arange(K)[None, :, None])
    is_master = valid & ~jnp.any(later_same, axis=-1)                        # [N, K]
    tidx = jnp.arange(N)[:, None]
    rows = back[jnp.maximum(onode, 0), tidx, jnp.maximum(slot_k, 0)]         # [N, K, H]
    f32 = jnp.float32
    acc = jnp.full((N, y.shape[1]), -0.0, f32)
    for b in biases:
        acc = acc + b.astype(f32)
    for k in range(K):
        acc = acc + jnp.where(is_master[:, k, None], rows[:, k].astype(f32), jnp.array(-0.0, f32))
    has_term = jnp.any(valid, axis=-1) if not biases else jnp.ones((N,), bool)
    out = jnp.where(has_term[:, None], acc, 0.0)
    if y.dtype == jnp.bfloat16:
        # An explicit rounding: XLA may drop a convert pair f32 -> bf16 -> f32 when the caller's f32 math on the
        # result fuses with it ("excess precision"); the flat op's result comes out of a custom call, rounded.
        out = jax.lax.reduce_precision(out, exponent_bits=8, mantissa_bits=7)
    out = out.astype(y.dtype)
    out_w = None
    if w is not None:
        bw = ctx.node_all_to_all(cw.reshape(Nn, N, S, K))
        kk = jnp.arange(K)[None, :]
        out_w = jnp.where(valid, bw[jnp.maximum(onode, 0), tidx, jnp.maximum(slot_k, 0), kk], 0.0).astype(f32)
    return out, out_w, t


# ----------------------------------------------------------------------------------------------- autodiff
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_p(cfg, zero_padding, x, w, sf, topk, token):
    return _dispatch_impl(cfg, zero_padding, x, w, sf, topk, token)


def _dispatch_fwd(cfg, zero_padding, x, w, sf, topk, token):
    out = _dispatch_impl(cfg, zero_padding, x, w, sf, topk, token)
    return out, (out[3], x, w, token)


def _dispatch_grad(cfg, h, x, w, token, g_x, g_w, g_tok):
    """(dx, dw, token cotangent) of a (cached) dispatch: the combine of the received rows' cotangents through the
    handle h (FP8 inputs get no dx)."""
    ep = _ep()
    g_x = ep._float_ct(g_x, jnp.zeros((cfg.rows, x.shape[1]), x.dtype))
    y = g_x if ep._is(g_x.dtype, ep._COMBINE_DTYPES) else g_x.astype(jnp.float32)
    gw = None
    if w is not None:
        gw = ep._float_ct(g_w, jnp.zeros((cfg.rows,) if cfg.expand else (cfg.token_rows, cfg.topk), jnp.float32))
    g_tok = ep._float_ct(g_tok, token)
    dx, dw, t = _combine_impl(cfg, cfg.ctx.varying(y), None if gw is None else cfg.ctx.varying(gw), (), h,
                              cfg.ctx.varying(g_tok.astype(jnp.float32)))
    dx = None if ep._is(x.dtype, (jnp.float8_e4m3fn,)) else dx.astype(x.dtype)
    return dx, dw, jax.lax.convert_element_type(t, token.dtype) + jnp.zeros_like(token)


def _dispatch_bwd(cfg, zero_padding, saved, g):
    h, x, w, token = saved
    g_x, _, g_w, g_h = g
    dx, dw, tok_ct = _dispatch_grad(cfg, h, x, w, token, g_x, g_w, g_h.token)
    return dx, dw, None, None, tok_ct


_dispatch_p.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cached_p(cfg, zero_padding, x, w, sf, h, token):
    return _cached_impl(cfg, zero_padding, x, w, sf, h, token)


def _cached_fwd(cfg, zero_padding, x, w, sf, h, token):
    return _cached_impl(cfg, zero_padding, x, w, sf, h, token), (h, x, w, token)


def _cached_bwd(cfg, zero_padding, saved, g):
    h, x, w, token = saved
    g_x, _, g_w, g_tok = g
    dx, dw, tok_ct = _dispatch_grad(cfg, h, x, w, token, g_x, g_w, g_tok)
    return dx, dw, None, jax.tree_util.tree_map(lambda _: None, h), tok_ct


_cached_p.defvjp(_cached_fwd, _cached_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_p(cfg, y, w, biases, h, token):
    return _combine_impl(cfg, y, w, biases, h, token)


def _combine_fwd(cfg, y, w, biases, h, token):
    return _combine_impl(cfg, y, w, biases, h, token), (y, w, biases, h, token)


def _combine_bwd(cfg, saved, g):
    ep = _ep()
    y, w, biases, h, token = saved
    g_x, g_w, g_tok = g
    N, H, K = cfg.num_tokens, y.shape[1], cfg.topk
    ctx = cfg.ctx
    g_x = ctx.varying(ep._float_ct(g_x, jnp.zeros((N, H), y.dtype)))
    g_tok = ep._float_ct(g_tok, token)
    gw = None if w is None else ctx.varying(ep._float_ct(g_w, jnp.zeros((N, K), jnp.float32)))
    dy, _, dw, t = _cached_impl(cfg, cfg.expand, g_x, gw, None, h, ctx.varying(g_tok.astype(jnp.float32)))
    valid = ep._valid_rows(cfg, h.psum_num_recv_tokens_per_rank[-1], h.psum_num_recv_tokens_per_expert,
                           h.num_unaligned_recv_tokens_per_expert)
    dy = jnp.where(valid[:, None], dy, jnp.zeros((), dy.dtype))
    if w is not None:
        dw = jnp.where(valid, dw, 0.0) if cfg.expand else jnp.where(valid[:, None] & (h.recv_topk_idx >= 0), dw, 0.0)
    db = tuple(g_x.astype(b.dtype) for b in biases)
    tok_ct = jax.lax.convert_element_type(t, token.dtype) + jnp.zeros_like(token)
    return dy, dw, db, jax.tree_util.tree_map(lambda _: None, h), tok_ct


_combine_p.defvjp(_combine_fwd, _combine_bwd)


# ------------------------------------------------------------------------------------------- entry points
def dispatch(x, topk_idx, topk_weights, *, ctx, num_experts, max_tokens_per_rank, expand, expert_alignment,
             zero_padding, x_scales, handle, num_sms, token, config=None):
    """``jax_engram.dispatch`` over a :class:`HierContext` (same arguments and results as the flat op)."""
    from jax_engram import _call

    ep = _ep()
    _call.check_axis(ctx, "dispatch")
    R = ctx.num_ranks
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"jax_engram.dispatch: x must be [num_tokens, hidden], got shape {x.shape}")
    N, H = x.shape
    E = ep._check_int("num_experts", num_experts, 1)
    M = ep._check_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    A = ep._check_int("expert_alignment", expert_alignment, 1)
    sms = 0 if num_sms is None else ep._check_int("num_sms", num_sms, 0)
    expand, zero_padding = bool(expand), bool(zero_padding)
    if E % R != 0:
        raise ValueError(f"jax_engram.dispatch: num_experts={E} must be a multiple of the {R} ranks of the "
                         f"group {ctx.axis_name!r}")
    if N > M:
        raise ValueError(f"jax_engram.dispatch: x has {N} tokens but max_tokens_per_rank={M}")
    if zero_padding and not expand:
        raise ValueError("jax_engram.dispatch: zero_padding requires expand=True")
    if x_scales is not None:
        x_scales = jnp.asarray(x_scales)
        if x_scales.ndim != 2 or x_scales.shape[0] != N:
            raise ValueError(f"jax_engram.dispatch: x_scales must be [N={N}, P], got shape {x_scales.shape}")
    if handle is not None:
        if not getattr(handle, "hierarchical", False):
            raise TypeError("jax_engram.dispatch: handle must be the handle of a dispatch over this hierarchical "
                            f"context, got {type(handle).__name__}")
        c = handle.config
        mism = [(n, a, b) for n, a, b in (("ctx", c.ctx, ctx), ("num_experts", c.num_experts, E),
                                          ("max_tokens_per_rank", c.max_tokens_per_rank, M),
                                          ("expand", c.expand, expand), ("expert_alignment", c.expert_alignment, A),
                                          ("num_tokens", c.num_tokens, N)) if a is not b and a != b]
        if mism:
            raise ValueError("jax_engram.dispatch: the handle comes from a dispatch with a different "
                             + ", ".join(f"{n} (handle {a!r}, here {b!r})" for n, a, b in mism))
        cfg = dataclasses.replace(c, num_sms=sms, ep=c.ep if config is None else config)
        K = c.topk
    else:
        if topk_idx is None:
            raise ValueError("jax_engram.dispatch: topk_idx is required (or pass handle= to replay a layout)")
        topk_idx = jnp.asarray(topk_idx)
        if topk_idx.ndim != 2 or topk_idx.shape[0] != N:
            raise ValueError(f"jax_engram.dispatch: topk_idx must be [N={N}, K], got shape {topk_idx.shape}")
        K = topk_idx.shape[1]
        if not 1 <= K <= ep.MAX_TOPK:
            raise ValueError(f"jax_engram.dispatch: top-k = {K} must be in [1, {ep.MAX_TOPK}]")
        cfg = ep._Config(ctx, R, E, M, N, K, expand, A, sms, ctx.ep_config if config is None else config)
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        if topk_weights.shape != (N, K) or topk_weights.dtype != jnp.float32:
            raise ValueError(f"jax_engram.dispatch: topk_weights must be float32 [N, K] = {(N, K)}, got "
                             f"{topk_weights.dtype}{list(topk_weights.shape)}")
    v = ctx.varying
    x = v(x)
    w = None if topk_weights is None else v(topk_weights)
    sf = None if x_scales is None else v(x_scales)
    if token is None and handle is not None:
        token = handle.token
    tok = v(jnp.zeros((), jnp.float32) if token is None else jnp.asarray(token).astype(jnp.float32))
    if handle is None:
        topk = v(topk_idx.astype(jnp.int32))
        recv_x, recv_sf, recv_w, h = _dispatch_p(cfg, zero_padding, x, w, sf, topk, tok)
    else:
        recv_x, recv_sf, recv_w, t = _cached_p(cfg, zero_padding, x, w, sf, handle, tok)
        h = handle.replace(token=t, config=cfg)
    return ep.DispatchResult(recv_x, recv_sf, None if cfg.expand else h.recv_topk_idx, recv_w, h.num_recv_tokens,
                             h.group_sizes, h, h.token)


def combine(y, handle, *, topk_weights=None, bias=None, token=None, return_token: bool = False):
    """``jax_engram.combine`` of a hierarchical dispatch (same arguments and results as the flat op)."""
    from jax_engram import _call

    ep = _ep()
    cfg = handle.config
    ctx = cfg.ctx
    _call.check_axis(ctx, "combine")
    y = jnp.asarray(y)
    if y.ndim != 2 or y.shape[0] != cfg.rows:
        raise ValueError(f"jax_engram.combine: y must be [{cfg.rows}, hidden] (the receive layout of the handle's "
                         f"dispatch), got shape {y.shape}")
    if not ep._is(y.dtype, ep._COMBINE_DTYPES):
        raise TypeError(f"jax_engram.combine: y must be bfloat16 (or float32), got {y.dtype}")
    N, H, K = cfg.num_tokens, y.shape[1], cfg.topk
    w = None
    if topk_weights is not None:
        w = jnp.asarray(topk_weights)
        want = (cfg.rows,) if cfg.expand else (cfg.token_rows, K)
        if w.shape != want or w.dtype != jnp.float32:
            raise ValueError(f"jax_engram.combine: topk_weights must be float32 {list(want)}, got {w.dtype}"
                             f"{list(w.shape)}")
        w = ctx.varying(w)
    biases = () if bias is None else tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if len(biases) > 2:
        raise ValueError(f"jax_engram.combine: at most two bias arrays, got {len(biases)}")
    for i, b in enumerate(biases):
        if jnp.shape(b) != (N, H) or jnp.asarray(b).dtype != y.dtype:
            raise ValueError(f"jax_engram.combine: bias[{i}] must be [N, H] = {(N, H)} of y's dtype")
    biases = tuple(ctx.varying(b) for b in biases)
    tok = ctx.varying(jnp.asarray(handle.token if token is None else token).astype(jnp.float32))
    cx, cw, t = _combine_p(cfg, ctx.varying(y), w, biases, handle, tok)
    out = (cx, cw)
    return out + (t,) if return_token else out
