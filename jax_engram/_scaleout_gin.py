"""GIN (NCCL's GPU-initiated networking) for the inter-node leg of a hierarchical Engram lookup.

The collective path (``jax.lax.all_to_all`` over the node axis, see :mod:`jax_engram._scaleout`) is the default
and the one tuned. The GIN path replaces that leg where the network can do it: the requester reads each row
owned by another node straight from the owner's window with ``ncclGin`` gets (requests aggregated per peer, one
completion per peer; ``ffi/kernels/cuda/engram_gin.cu``), grouped exactly as the collective path buckets ids
(``ffi/include/jax_engram/engram_gin_plan.h``; tests hold the two equal).

It needs: a CUDA build against NCCL >= 2.30.4 headers, a libnccl that new, more than one node, and NCCL
reporting a GIN backend (an RDMA NIC with GPUDirect) on every node. :func:`probe` asks in that order, at
context init, and never fails when GIN is absent: it returns the path and why. The node's side NCCL
communicator, which answers the last question, is created only when everything before it holds, so
single-node, CPU and NIC-less jobs create none. Where every node reports GIN, probe creates what the handler
(``jax_engram_engram_gin_fetch``) launches on: a cross-node NCCL communicator over every rank of the group
(unique id through the context's exchange, non-blocking init bounded by the context timeout), its GIN device
communicator and a staging window (:data:`STAGING_BYTES` per GPU); the path is GIN only if that succeeded on
every process. Each Engram table of a GIN context then registers its shard (and its scale-factor copy) as GIN
windows (:func:`register_table`, collective, at table creation; released by ``free()``); a table whose
registration fails anywhere stays on the collective path. ``ctx.close()`` frees the communicator.

Tested: the lowering, the request accounting and the probe's agreement across processes. The GIN fetch itself
is experimental: it is not yet tested on a GIN-capable network.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from jax_engram import _call

XLA = "xla all_to_all"
GIN = "gin"
_MIN_NCCL = 23004  # 2.30.4
STAGING_BYTES = 32 << 20  # per GPU: one slice per peer rank; lookups larger than a slice run in rounds


def _version(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _agree(inner, name: str, why: str, after_steps: int) -> str:
    """Collective: share this process's reason ("" = fine) and return the first process's non-empty one.

    Every process must reach the same answer. The step before this exchange may end at once on one process (a
    local check failed) while a peer still waits in it (a collective registration, each of its ``after_steps``
    waits bounded by the context timeout): the exchange waits for the slowest possible peer plus its own bound, so
    a process that failed fast does not time out while its peers go on. Only a peer that died makes it time out,
    and then every surviving process raises the same TimeoutError."""
    procs = [str(p) for p in inner.process_ids]
    recs = inner._exchange.allgather(name, {str(jax.process_index()): why}, procs,
                                     timeout_s=(after_steps + 1) * inner.timeout_s)
    return next((f"process {p}: {r}" for p, r in sorted(recs.items()) if r), "")


# Waits bounded by the context timeout in each collective step of probe (see _agree): nccl_topology (barrier,
# unique id, communicator init, window registration), _init_comm (unique id, GIN communicator init).
_TOPOLOGY_STEPS, _INIT_STEPS = 4, 2


def probe(ctx) -> tuple[str, str]:
    """(inter-node path, reason) of a :class:`~jax_engram.context.HierContext`. Collective over the processes
    of the context only past the single-node / CPU checks (which every process answers alike); every process
    returns the same answer, or raises the same error when a process died."""
    if ctx.platform != "gpu":
        return XLA, "CPU context: GIN is a GPU network path"
    if ctx.num_nodes == 1:
        return XLA, "one node: no id crosses nodes"
    inner = ctx.inner
    sup = inner._native.gin_support()
    why = sup["reason"] or ("ranks share a GPU (no NCCL communicator)" if inner.ranks_per_gpu > 1 else "")
    why = _agree(inner, "gin_support", why, 0)
    if why:
        return XLA, why
    try:
        inner.nccl_topology()
        qs = [inner._native.gin_query(inner.id, m.ordinal) for m in inner.members]
        why = "; ".join(sorted({q["reason"] for q in qs if q["gin_type"] <= 0 and q["railed_gin_type"] <= 0}))
    except Exception as e:  # a node without a working communicator has no GIN either
        why = f"the node's NCCL communicator could not be asked: {e}"
    why = _agree(inner, "gin_query", why, _TOPOLOGY_STEPS)
    if why:
        return XLA, why
    try:
        _init_comm(ctx)
    except Exception as e:  # every process learns it below and stays on the collective path
        why = f"the cross-node GIN communicator could not be created: {e}"
    why = _agree(inner, "gin_init", why, _INIT_STEPS)
    if why:
        release(ctx)
        return XLA, why
    return GIN, "NCCL reports GIN on every node; the cross-node GIN communicator is up"


def _hier_groups(ctx) -> list[list[tuple]]:
    """Per hierarchical group of the mesh (one per index of the axes outside the EP group): [(device, global
    rank, node)] with global rank = node * local_size + local, node = the node axes' index (row-major)."""
    mesh = ctx.mesh
    names = list(mesh.axis_names)
    groups: dict[tuple, list] = {}
    for idx in np.ndindex(mesh.devices.shape):
        c = dict(zip(names, idx))
        node = int(np.ravel_multi_index(tuple(c[a] for a in ctx.node_axes),
                                        tuple(mesh.shape[a] for a in ctx.node_axes)))
        key = tuple(c[a] for a in names if a not in ctx.axis_name)
        groups.setdefault(key, []).append((mesh.devices[idx], node * ctx.local_size + c[ctx.local_axis], node))
    return [sorted(g, key=lambda t: t[1]) for _, g in sorted(groups.items())]


def _init_comm(ctx) -> None:
    """Collective: the cross-node GIN communicator, staging and device communicator of every local member."""
    inner = ctx.inner
    ordinal = {m.device.id: m.ordinal for m in inner.members}
    me = jax.process_index()
    for gi, group in enumerate(_hier_groups(ctx)):
        local = [(ordinal[d.id], r, n) for d, r, n in group if d.process_index == me]
        if not local:
            continue
        root = min(d.process_index for d, _, _ in group)
        uid = inner._native.nccl_unique_id() if me == root else None
        uid = inner._exchange.broadcast_bytes(f"gin_uid/{gi}", uid, root)
        inner._native.gin_init(ctx.id, local, ctx.num_ranks, uid, STAGING_BYTES)


def release(ctx) -> None:
    """Local: frees this process's GIN state of the context (also done by ``close()``)."""
    native = ctx.inner._native
    if hasattr(native, "gin_release"):
        for m in ctx.inner.members:
            native.gin_release(ctx.id, m.ordinal)


# ------------------------------------------------------------------------------------------------ tables
@dataclasses.dataclass(frozen=True)
class GinTable:
    """A table's GIN windows: the data shard and (with scale factors) the node's scale-factor copy, each as
    (window id, byte offset of the region in that window)."""

    window: int
    offset: int
    sf_window: int = -1
    sf_offset: int = 0


_window_ids = itertools.count(1)


def register_table(table) -> tuple[GinTable | None, str]:
    """Collective (every process creates the same tables in the same order): the table's GIN windows, or
    (None, why) when any process could not register them (the table then uses the collective path)."""
    ctx = table.ctx
    inner = ctx.inner
    wid = next(_window_ids)
    regions = [(wid, table.region)] + ([(wid + 1, table.sf_region)] if table.num_sf_packs else [])
    next(_window_ids)
    offsets, why = [], ""
    try:
        for w, r in regions:
            off = None
            for g in sorted({m.group for m in inner.members}):
                ords = [m.ordinal for m in inner.members if m.group == g]
                off = inner._native.gin_register_window(ctx.id, ords, w, r.alloc_id, r.offset, r.nbytes)
            offsets.append(off)
    except Exception as e:
        why = f"registering the table for GIN failed: {e}"
    why = _agree(inner, f"gin_table/{wid}", why, len(regions) * len({m.group for m in inner.members}))
    if why:
        _release_windows(ctx, [w for w, _ in regions])
        return None, why
    sf = regions[1][0] if len(regions) > 1 else -1
    return GinTable(wid, offsets[0], sf, offsets[1] if len(regions) > 1 else 0), ""


def _release_windows(ctx, wids) -> None:
    native = ctx.inner._native
    for m in ctx.inner.members:
        for w in wids:
            native.gin_release_window(ctx.id, m.ordinal, w)


def release_table(table) -> None:
    """Local: deregisters the table's GIN windows (before its memory is released)."""
    g = getattr(table, "_gin", None)
    if g is not None and not table.ctx._closed:
        _release_windows(table.ctx, [g.window] + ([g.sf_window] if g.sf_window >= 0 else []))
    table._gin = None


# ------------------------------------------------------------------------------------------------ lookup
def fetch(ctx, ids, rows, *, window: int, region_offset: int, num_entries: int, row_bytes: int,
          local_stride: int, mode: int):
    """The GIN leg of a lookup: ids [T, E] global (int32), rows [T, E*w] from the intra-node lookup (rows of this
    node filled, the rest zero) -> rows with the rows of other nodes read from their owners' windows. Same
    resolution of ids as the collective path (mode, padding)."""
    out = [_call.like(rows), _call.like(rows, (), np.int32)]
    # The attributes: EngramGinFetchAttrs (ffi/handlers/engram_bindings.h), all of them (ctx_id added by call).
    rows, _ = _call.call(ctx, "jax_engram_engram_gin_fetch", out, ids, rows, input_output_aliases={1: 0},
                         window_id=window, num_entries=num_entries, ranks_per_node=ctx.local_size,
                         nodes=ctx.num_nodes, row_bytes=row_bytes, region_offset=region_offset,
                         local_stride=local_stride, mode=mode)
    return rows
