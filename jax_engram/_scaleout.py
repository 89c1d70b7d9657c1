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
factors travel with the rows.

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

    def __init__(self, mesh, axes: tuple, *, device_bytes, host_bytes, timeout_s: float, cuda_graphs: bool = False):
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
                             timeout_s=timeout_s, cuda_graphs=cuda_graphs)
        self.platform = self.inner.platform
        self.timeout_s = self.inner.timeout_s
        self.cuda_graphs = self.inner.cuda_graphs
        self.id = self.inner.id
        self.device_bytes, self.host_bytes = self.inner.device_bytes, self.inner.host_bytes

    # The node axis as jax.lax collectives take it (a name or a tuple of names).
    @property
    def node_axis(self):
        return self.node_axes[0] if len(self.node_axes) == 1 else self.node_axes

    @property
    def inter_node_path(self) -> str:
        return "xla all_to_all (static capacity, same-rail)"

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
                  else "jax_engram windows (NVLink)", "gin": "not available (collective path)",
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
        """EngramTable over a :class:`HierContext` (same API; see the module docstring for the path)."""

        def __init__(self, ctx, num_entries: int, hidden: int, dtype=jnp.bfloat16, *, placement: str = "host",
                     num_sf_packs: int = 0, sf_dtype=np.float32, sf_placement: str = "device"):
            inner = EngramTable(ctx.inner, num_entries, hidden, dtype, placement=placement,
                                num_sf_packs=num_sf_packs, sf_dtype=sf_dtype, sf_placement=sf_placement)
            self.inner = inner
            self.ctx = ctx
            for k in ("num_entries", "hidden", "dtype", "placement", "num_sf_packs", "sf_dtype", "sf_placement",
                      "row_bytes", "nbytes", "_uid", "region", "sf_region"):
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

        def __repr__(self) -> str:
            return f"Hierarchical{super().__repr__()} ({self.ctx.num_nodes} nodes x {self.ctx.local_size})"

        def write(self, storage, sf=None, *, token=None):
            from jax_engram import _call

            _call.check_axis(self.ctx, "EngramTable.write")
            if self.num_sf_packs and sf is not None:
                sf = jnp.asarray(sf)
                if sf.shape != (self.total_entries, self.num_sf_packs):
                    raise ValueError(f"jax_engram EngramTable.write: sf must be the replicated table [num_ranks*"
                                     f"num_entries, num_sf_packs] = [{self.total_entries}, {self.num_sf_packs}] "
                                     f"indexed by global id, got {sf.shape}")
                # This node's rows of the replicated table: the inner table serves them with the data rows.
                sf = jax.lax.dynamic_slice_in_dim(sf, self.ctx.node_index() * self.node_entries, self.node_entries)
            return self.inner.write(storage, sf, token=token)

        def fetch(self, indices, token=None, *, mode: str = "fill", sf_layout: str = "row",
                  overlap: bool = True) -> EngramPending:
            """As the flat fetch; the whole path (inter-node exchange, inner reads, exchange back) runs here and
            ``wait`` only hands the result over (``overlap`` has no effect on this path)."""
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
            data, sf, status = _engram_fetch(self, indices, token, mode, sf_layout)
            return EngramPending(data, sf, status, indices, bool(self.num_sf_packs), False)

        def wait(self, pending: EngramPending, token=None):
            from jax_engram import _call

            _call.check_axis(self.ctx, "EngramTable.wait")
            if not isinstance(pending, EngramPending):
                raise TypeError(f"jax_engram EngramTable.wait: expected the EngramPending returned by fetch, got "
                                f"{type(pending).__name__}")
            return pending.data, (pending.sf if pending.has_sf else None)

        def lookup_global(self, ids, *, mode: str = "fill", sf_layout: str = "row", sharded: bool | None = None):
            if sharded is None:
                from jax.sharding import NamedSharding

                spec = ids.sharding.spec if isinstance(ids, jax.Array) and isinstance(ids.sharding,
                                                                                       NamedSharding) else ()
                first = spec[0] if len(spec) else None
                first = first if isinstance(first, tuple) else (first,)
                sharded = all(a in first for a in self.ctx.axis_name)
            return super().lookup_global(ids, mode=mode, sf_layout=sf_layout, sharded=sharded)

        def _lookup_fn(self, mode, sf_layout, sharded):
            if sharded:
                return super()._lookup_fn(mode, sf_layout, sharded)
            key = ("lookup", mode, sf_layout, sharded)
            fn = self._global_fns.get(key)
            if fn is None:
                from jax.sharding import PartitionSpec as P

                ax = self.ctx.axis_name

                def body(ids, tok):
                    data, sf = self.wait(self.fetch(ids, tok, mode=mode, sf_layout=sf_layout))
                    sf = sf if sf is not None else jnp.zeros((0,), jnp.int32)
                    return data, sf, (tok + jnp.zeros((1,), tok.dtype) * data.reshape(-1)[:1].size)

                # Replicated ids: every rank computes the same rows, but the inter-node exchange makes them
                # "varying" for shard_map's type check; the replicated outputs are stated, not inferred.
                fn = jax.jit(jax.shard_map(body, mesh=self.ctx.mesh, in_specs=(P(), P(ax)),
                                           out_specs=(P(), P(), P(ax)), check_vma=False))
                self._global_fns[key] = fn
            return fn

        def free(self) -> None:
            self.inner.free()
            self.region = self.sf_region = None

    return _HierEngramTable


@functools.lru_cache(maxsize=None)
def hier_engram_table_class():
    return _engram_table_class()


def _engram_fetch(table, ids, token, mode, sf_layout):
    """ids [T, E] int32 global ids -> (data [T, E*hidden], sf per sf_layout, status)."""
    ctx = table.ctx
    T, E = ids.shape
    H, Pk, Nn = table.hidden, table.num_sf_packs, ctx.num_nodes
    total, per_node = table.total_entries, table.node_entries
    ids = ctx.varying(ids)
    g = jnp.minimum(ids, total - 1) if mode == "clip" else ids
    valid = (g >= 0) & (g < total)
    owner = jnp.where(valid, g // per_node, -1)                                  # owner node or -1
    nodes = jnp.arange(Nn, dtype=jnp.int32)[:, None, None]
    # Bucket b: the node-local ids this rank wants from node b, -1 (padding) elsewhere; capacity T*E.
    buckets = jnp.where(owner[None] == nodes, g[None] - nodes * per_node, -1)   # [Nn, T, E]
    req = ctx.node_all_to_all(buckets)                                           # [Nn, T, E] from node a
    inner_tok = req if token is None else token
    data, sf = table.inner.lookup(req.reshape(Nn * T, E), inner_tok, mode="fill", sf_layout="row")
    rows = ctx.node_all_to_all(data.reshape(Nn, T, E, H))                        # [Nn, T, E, H] from node b
    sel = jnp.clip(owner, 0, Nn - 1)[None, :, :, None]
    out = jnp.take_along_axis(rows, sel, axis=0)[0]
    out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype)).reshape(T, E * H)
    sf_out = jnp.zeros((0,), jnp.int32)
    if Pk:
        sfr = ctx.node_all_to_all(sf.reshape(Nn, T, E, Pk))
        s = jnp.take_along_axis(sfr, sel, axis=0)[0]
        s = jnp.where(valid[..., None], s, jnp.zeros((), s.dtype)).reshape(T, E * Pk)
        if sf_layout == "tma_col_major":
            Tp = (T + 3) // 4 * 4
            s = jnp.pad(s.T, ((0, 0), (0, Tp - T)))
        sf_out = s
    status = jnp.zeros((), jnp.int32)
    if mode == "checked":
        status = _checked(ctx, ids, total, out)
    return out, sf_out, status


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

    st = io_callback(cb, jax.ShapeDtypeStruct((), jnp.int32), any_bad, pos, flat[pos], rank, dep[0])
    return jnp.where(any_bad, pos, st)
