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
single-node, CPU and NIC-less jobs create none. The cross-node GIN device communicator that the handler
(``jax_engram_engram_gin_fetch``) launches on is not created yet, so even where NCCL reports GIN the lookup
stays on the collective path, and the reason says so.
"""
from __future__ import annotations

import jax

XLA = "xla all_to_all"
GIN = "gin"
_MIN_NCCL = 23004  # 2.30.4


def _version(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def probe(ctx) -> tuple[str, str]:
    """(inter-node path, reason) of a :class:`~jax_engram._scaleout.HierContext`. Collective over the processes
    of the context only past the single-node / CPU checks (which every process answers alike)."""
    if ctx.platform != "gpu":
        return XLA, "CPU context: GIN is a GPU network path"
    if ctx.num_nodes == 1:
        return XLA, "one node: no id crosses nodes"
    inner = ctx.inner
    sup = inner._native.gin_support()
    why = sup["reason"] or ("ranks share a GPU (no NCCL communicator)" if inner.ranks_per_gpu > 1 else "")
    procs = [str(p) for p in inner.process_ids]
    me = str(jax.process_index())
    recs = inner._exchange.allgather("gin_support", {me: why}, procs)
    why = next((f"process {p}: {r}" for p, r in sorted(recs.items()) if r), "")
    if why:
        return XLA, why
    try:
        inner.nccl_topology()
        qs = [inner._native.gin_query(inner.id, m.ordinal) for m in inner.members]
        why = "; ".join(sorted({q["reason"] for q in qs if q["gin_type"] <= 0 and q["railed_gin_type"] <= 0}))
    except Exception as e:  # a node without a working communicator has no GIN either
        why = f"the node's NCCL communicator could not be asked: {e}"
    recs = inner._exchange.allgather("gin_query", {me: why}, procs)
    why = next((f"process {p}: {r}" for p, r in sorted(recs.items()) if r), "")
    if why:
        return XLA, why
    return XLA, ("NCCL reports GIN on every node, but the cross-node GIN device communicator is not created by this "
                 "version; the collective path serves every lookup")
