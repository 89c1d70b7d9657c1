"""The Engram request plan (ffi/include/jax_engram/engram_gin_plan.h) that the GIN path of a hierarchical
table issues its gets from: checked against a numpy model and against the collective path's bucketing
(jax_engram._scaleout.engram_buckets), so both inter-node paths read the same rows in the same order. Then the
selection: probe's answers, and the hierarchical lookup lowered for CUDA with the GIN path forced (the GIN
custom call, no all_to_all) and by default (all_to_all). No machine here has GIN: the fetch itself never runs."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT
from jax_engram import _ffi
from jax_engram._scaleout import engram_buckets

MODES = {"fill": 0, "clip": 1, "checked": 2}


def _plan(ids, mode, E, L, Nn, row_bytes, off, stride=0, C=1 << 40):
    p = _ffi.native("cpu").engram_gin_plan(np.asarray(ids, np.int32).ravel().tolist(), MODES[mode], E, L, Nn,
                                            row_bytes, off, stride, C)
    return {k: np.asarray(v, np.int64) for k, v in p.items()}


def _model(ids, mode, E, L, Nn, row_bytes, off, stride=0, C=1 << 40):
    """numpy model: resolve, owner by division, stable grouping by owner rank, staging slices of C rows."""
    flat = np.asarray(ids, np.int64).ravel()
    total = E * L * Nn
    g = np.where(flat >= total, total - 1 if mode == "clip" else -1, flat)
    g = np.where(flat < 0, -1, g)
    ok = g >= 0
    rank = np.where(ok, g // E, -1)
    row = np.where(ok, g % E, -1)
    order = np.flatnonzero(ok)[np.argsort(rank[ok], kind="stable")]
    counts = np.bincount(rank[ok], minlength=L * Nn)
    slot = np.full(flat.shape, -1)
    slot[order] = np.arange(order.size)
    peer_offset = np.concatenate([[0], np.cumsum(counts)])
    k = np.where(ok, slot - peer_offset[np.maximum(rank, 0)], -1)
    return {"owner_rank": rank, "owner_node": np.where(ok, rank // L, -1), "owner_local": np.where(ok, rank % L, -1),
            "row": row, "node_local_id": np.where(ok, g % (E * L), -1),
            "remote_offset": np.where(ok, off + (rank % L) * stride + row * row_bytes, -1), "peer_count": counts,
            "peer_offset": peer_offset, "order": order, "slot": slot,
            "staging_row": np.where(ok, rank * C + k % C, -1), "round": np.where(ok, k // C, -1),
            "node_count": np.bincount(rank[ok] // L, minlength=Nn)}


CASES = [  # (nodes, ranks per node, entries per rank, T, E)
    (2, 2, 5, 6, 3), (3, 4, 7, 5, 4), (1, 3, 4, 4, 2), (4, 1, 3, 8, 1), (2, 8, 64, 16, 5)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("Nn,L,E,T,K", CASES)
def test_plan_matches_numpy_model(Nn, L, E, T, K, mode):
    rng = np.random.default_rng(Nn * 1000 + L * 100 + E + T + K)
    total = Nn * L * E
    ids = rng.integers(-3, total + 4, size=(T, K)).astype(np.int32)
    ids[0, 0] = total - 1
    row_bytes, off = 2 * 96, 4096
    got = _plan(ids, mode, E, L, Nn, row_bytes, off)
    want = _model(ids, mode, E, L, Nn, row_bytes, off)
    assert set(got) == set(want)
    assert np.all(got["round"][got["owner_rank"] >= 0] == 0)  # one round when the staging holds the lookup
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # Slots of peer p form [peer_offset[p], peer_offset[p+1]) in flat order; rank order is node-major.
    for p in range(Nn * L):
        s = got["order"][got["peer_offset"][p]:got["peer_offset"][p + 1]]
        assert np.all(got["owner_rank"][s] == p) and np.all(np.diff(s) > 0)
    assert np.all(np.diff(got["owner_node"][got["order"]]) >= 0)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("Nn,L,E,T,K", CASES)
def test_plan_matches_collective_buckets(Nn, L, E, T, K, mode):
    """Bucket b of the collective path holds, at every flat position, exactly the plan's node-local id of the
    ids that node b owns; its valid entries per bucket are the plan's node_count."""
    rng = np.random.default_rng(7 + Nn * L * E * T * K)
    total = Nn * L * E
    ids = rng.integers(-2, total + 3, size=(T, K)).astype(np.int32)
    got = _plan(ids, mode, E, L, Nn, 64, 0)
    valid, owner, buckets = jax.jit(engram_buckets, static_argnums=(1, 2, 3, 4))(
        jnp.asarray(ids), total, L * E, Nn, mode)
    buckets = np.asarray(buckets).reshape(Nn, -1)
    np.testing.assert_array_equal(np.asarray(owner).ravel(), got["owner_node"])
    np.testing.assert_array_equal(np.asarray(valid).ravel(), got["owner_rank"] >= 0)
    for b in range(Nn):
        want = np.where(got["owner_node"] == b, got["node_local_id"], -1)
        np.testing.assert_array_equal(buckets[b], want, err_msg=f"bucket {b}")
    np.testing.assert_array_equal((buckets >= 0).sum(axis=1), got["node_count"])
    # The collective bucket entry addresses the same (local rank, row) as the GIN request.
    ok = got["owner_rank"] >= 0
    np.testing.assert_array_equal(got["node_local_id"][ok] // E, got["owner_local"][ok])
    np.testing.assert_array_equal(got["node_local_id"][ok] % E, got["row"][ok])


@pytest.mark.parametrize("C", [1, 2, 3])
@pytest.mark.parametrize("Nn,L,E,T,K", CASES[:3])
def test_plan_rounds_and_replicated_stride(Nn, L, E, T, K, C):
    """Small staging slices (C rows per peer): request k of a peer is staged at row k % C of its slice in round
    k // C, so no two requests of one round share a staging row; scale factors (replicated in the node) are
    addressed with a per-local stride."""
    rng = np.random.default_rng(Nn + 10 * L + 100 * E + C)
    total = Nn * L * E
    ids = rng.integers(-1, total + 1, size=(T, K)).astype(np.int32)
    rb = 8
    got = _plan(ids, "clip", E, L, Nn, rb, 64, E * rb, C)
    want = _model(ids, "clip", E, L, Nn, rb, 64, E * rb, C)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    ok = got["owner_rank"] >= 0
    pairs = set(zip(got["staging_row"][ok].tolist(), got["round"][ok].tolist()))
    assert len(pairs) == int(ok.sum())
    assert np.all(got["staging_row"][ok] // C == got["owner_rank"][ok])
    # the stride addresses the node-local id's row in the node's replicated copy
    np.testing.assert_array_equal(got["remote_offset"][ok], 64 + got["node_local_id"][ok] * rb)
    assert _ffi.native("cpu").engram_gin_staging_rows(1000, 4, 16) == 15
    assert _ffi.native("cpu").engram_gin_staging_rows(32, 4, 16) == 0


def test_plan_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_entries"):
        _ffi.native("cpu").engram_gin_plan([0], 0, 0, 1, 1, 4, 0)
    with pytest.raises(ValueError, match="mode"):
        _ffi.native("cpu").engram_gin_plan([0], 5, 1, 1, 1, 4, 0)
    with pytest.raises(ValueError, match="staging_rows"):
        _ffi.native("cpu").engram_gin_plan([0], 0, 1, 1, 1, 4, 0, 0, 0)


class _FakeNative:
    def __init__(self, support, query, init_error=None):
        self.support, self.query, self.queried = support, query, []
        self.init_error, self.inits, self.released = init_error, [], []

    def gin_support(self):
        return dict(self.support)

    def gin_query(self, ctx_id, ordinal):
        self.queried.append(ordinal)
        return dict(self.query)

    def nccl_unique_id(self):
        return b"u" * 128

    def gin_init(self, ctx_id, members, nranks, uid, staging_bytes):
        self.inits.append((ctx_id, sorted(members), nranks, len(uid), staging_bytes))
        if self.init_error:
            raise RuntimeError(self.init_error)

    def gin_release(self, ctx_id, ordinal):
        self.released.append(ordinal)


class _FakeExchange:
    def allgather(self, name, local, want, *, timeout_s=None):
        return {k: local[k] for k in want}

    def broadcast_bytes(self, name, value, root):
        return value


class _FakeDevice:
    def __init__(self, i):
        self.id, self.process_index = i, jax.process_index()


class _FakeInner:
    def __init__(self, native, fail_topology=False):
        self._native, self._exchange, self.id, self.ranks_per_gpu = native, _FakeExchange(), 7, 1
        self.timeout_s = 100.0
        self.process_ids = [jax.process_index()]
        self.members = [type("M", (), {"ordinal": o, "device": _FakeDevice(10 + o)})() for o in (0, 1)]
        self.fail_topology, self.topology_calls = fail_topology, 0

    def nccl_topology(self):
        self.topology_calls += 1
        if self.fail_topology:
            raise RuntimeError("ncclCommInitRankConfig failed")
        return {}


def _fake_ctx(platform, nodes, native, **kw):
    """2 nodes x 1 GPU of one process (ordinals 0 and 1 = nodes 0 and 1)."""
    mesh = type("Mesh", (), {"axis_names": ("node", "gpu"), "shape": {"node": nodes, "gpu": 1},
                             "devices": np.array([[_FakeDevice(10 + o)] for o in range(nodes)], dtype=object)})()
    return type("C", (), {"platform": platform, "num_nodes": nodes, "inner": _FakeInner(native, **kw), "mesh": mesh,
                          "node_axes": ("node",), "local_axis": "gpu", "axis_name": ("node", "gpu"),
                          "local_size": 1, "num_ranks": nodes, "id": 7})()


_OK = {"compiled": True, "build_version": 23203, "runtime_version": 23203, "reason": ""}


def test_gin_probe_never_fails_and_says_why():
    """The inter-node path is "xla all_to_all" unless every check passes; the node's NCCL communicator is
    created (nccl_topology) only on multi-node GPU jobs whose build and libnccl can run GIN."""
    from jax_engram import _scaleout_gin as g

    no_gin = {"gin_type": 0, "railed_gin_type": 0, "reason": "NCCL reports no GIN backend"}
    for platform, nodes, sup, why in [
            ("cpu", 2, _OK, "CPU context"), ("gpu", 1, _OK, "one node"),
            ("gpu", 2, dict(_OK, compiled=False, reason="GIN not compiled in (NCCL 2.28.9 headers)"),
             "GIN not compiled in (NCCL 2.28.9 headers)")]:
        ctx = _fake_ctx(platform, nodes, _FakeNative(sup, no_gin))
        path, reason = g.probe(ctx)
        assert path == g.XLA and why in reason, (platform, nodes, reason)
        assert ctx.inner.topology_calls == 0 and ctx.inner._native.queried == []
    ctx = _fake_ctx("gpu", 2, _FakeNative(_OK, no_gin))
    assert g.probe(ctx) == (g.XLA, "process 0: NCCL reports no GIN backend")
    assert ctx.inner.topology_calls == 1 and ctx.inner._native.queried == [0, 1]
    ctx = _fake_ctx("gpu", 2, _FakeNative(_OK, no_gin), fail_topology=True)
    path, reason = g.probe(ctx)
    assert path == g.XLA and "ncclCommInitRankConfig failed" in reason
    gin = {"gin_type": 3, "railed_gin_type": 3, "reason": ""}
    ctx = _fake_ctx("gpu", 2, _FakeNative(_OK, gin))
    assert g.probe(ctx) == (g.GIN, "NCCL reports GIN on every node; the cross-node GIN communicator is up")
    # one communicator over the 2 ranks: (ordinal, global rank, node) of both local GPUs, the id, the staging
    assert ctx.inner._native.inits == [(7, [(0, 0, 0), (1, 1, 1)], 2, 128, g.STAGING_BYTES)]
    assert ctx.inner._native.released == []
    ctx = _fake_ctx("gpu", 2, _FakeNative(_OK, gin, init_error="ncclDevCommCreate(GIN) failed"))
    path, reason = g.probe(ctx)
    assert path == g.XLA and "cross-node GIN communicator could not be created" in reason
    assert "ncclDevCommCreate(GIN) failed" in reason and ctx.inner._native.released == [0, 1]


_LOWER = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu"); jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import PartitionSpec as P
import jax_engram as je
from jax_engram import _scaleout_gin as g

force = sys.argv[1] == "gin"
if force:  # what probe and registration return where NCCL reports GIN on every node
    g.probe = lambda ctx: (g.GIN, "forced by the test")
    g.register_table = lambda t: (g.GinTable(11, 4096, 12, 128), "")
    g.release_table = lambda t: setattr(t, "_gin", None)
A = ("node", "gpu")
mesh = jax.make_mesh((2, 2), A, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
with je.init(mesh, A) as ctx:
    t = je.EngramTable(8, 16, jnp.bfloat16, ctx=ctx, placement="device", num_sf_packs=2)
    assert t.inter_node_path == (g.GIN if force else g.XLA), t.inter_node_path
    assert ctx.info()["inter_node_path"] == (g.GIN if force else g.XLA)

    def body(ids, tok):
        data, sf = t.lookup(ids, after=tok, mode=sys.argv[2], sf_layout="tma_col_major")
        return data, sf

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(A), P(A)), out_specs=(P(A), P(A))))
    sh = jax.sharding.NamedSharding(mesh, P(A))
    args = (jax.ShapeDtypeStruct((4 * 3, 2), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sh))
    out = jax.eval_shape(f, *args)
    assert out[0].shape == (12, 2 * 16) and out[1].shape == (4 * 4, 4), out
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    def wbody(storage, sf):
        return t.write(storage, sf, after=storage[:1, :1].astype(jnp.float32).reshape(-1)).reshape(1)

    wf = jax.jit(jax.shard_map(wbody, mesh=mesh, in_specs=(P(A), P()), out_specs=P(A)))
    wargs = (jax.ShapeDtypeStruct((4 * 8, 16), jnp.bfloat16, sharding=sh),
             jax.ShapeDtypeStruct((32, 2), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P())))
    wtext = wf.trace(*wargs).lower(lowering_platforms=("cuda",)).as_text()
    t.free()
print("WRITE_ALL_REDUCES", wtext.count("stablehlo.all_reduce"))
print("TEXT_BEGIN")
print(text)
"""


def _lowered(path, mode):
    """(lookup lowered for CUDA, number of all_reduce in the lowered write)."""
    p = subprocess.run([sys.executable, "-c", _LOWER, path, mode], capture_output=True, text=True, timeout=300,
                       cwd=str(REPO_ROOT), env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0 and "TEXT_BEGIN" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    head, text = p.stdout.split("TEXT_BEGIN", 1)
    return text, int(head.split("WRITE_ALL_REDUCES", 1)[1].split()[0])


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_hier_lookup_lowers_to_gin_fetch_where_gin(mode):
    """With the GIN path (probe forced), the lookup lowered for CUDA runs the intra-node lookup of this node's
    bucket and two GIN fetches (rows, scale factors) with the table's windows and geometry, and no all_to_all;
    the default lowering crosses nodes with all_to_all and has no GIN call. A GIN table's write meets every rank
    before (its after=) and after (other nodes read the shard directly); the collective path's write does not."""
    import re

    gin, gin_write_reduces = _lowered("gin", mode)
    assert gin_write_reduces == 2
    calls = re.findall(r'custom_call @jax_engram_engram_gin_fetch\(.*', gin)
    assert len(calls) == 2, calls
    assert "all_to_all" not in gin
    assert gin.count("custom_call @jax_engram_engram_fetch") == 1
    attrs = [dict(re.findall(r"(\w+) = (-?\d+) : i64", c)) for c in calls]
    # The handler decodes the whole attribute dictionary into EngramGinFetchAttrs and never runs here (no GIN
    # NIC): the calls must carry exactly the struct's fields.
    header = (REPO_ROOT / "ffi" / "handlers" / "engram_bindings.h").read_text()
    decl = header.split("::jax_engram::EngramGinFetchAttrs,", 1)[1].split(";", 1)[0]
    fields = set(re.findall(r'StructMember<int64_t>\("(\w+)"\)', decl))
    assert "window_id" in fields and all(set(a) == fields for a in attrs), (fields, attrs)
    want_mode = str(MODES[mode])
    # rows: window 11 at 4096, 32-byte rows; scale factors: window 12 at 128, 2 packs of 4 bytes, stride 8 x 8
    assert [(a["window_id"], a["region_offset"], a["row_bytes"], a["local_stride"]) for a in attrs] == \
        [("11", "4096", "32", "0"), ("12", "128", "8", "64")], attrs
    for a in attrs:
        assert (a["num_entries"], a["ranks_per_node"], a["nodes"], a["mode"]) == ("8", "2", "2", want_mode), a
    xla, xla_write_reduces = _lowered("xla", mode)
    assert "all_to_all" in xla and "jax_engram_engram_gin_fetch" not in xla
    assert xla_write_reduces == 0


@pytest.mark.parametrize("scenario", ["fast_query", "fast_init", "dead"])
def test_gin_probe_processes_agree(tmp_path, scenario):
    """Two processes probe over a shared (directory) exchange. One fails fast (its local ginType check, or its GIN
    communicator) while the other still waits in a collective step for longer than the context timeout: both reach
    the same path and reason. When a process dies in a collective step, the survivor raises TimeoutError."""
    T = 1.0
    worker = str(REPO_ROOT / "tests" / "workers" / "gin_agreement.py")
    procs = [subprocess.Popen([sys.executable, worker, str(tmp_path), str(i), scenario, str(T)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                              env=dict(os.environ, JAX_PLATFORMS="cpu")) for i in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    res = [[json.loads(l[7:]) for l in o.splitlines() if l.startswith("RESULT ")] for o, _ in outs]
    if scenario == "dead":
        assert res[1] == [] and res[0] and res[0][0]["error"] == "TimeoutError", (res, outs)
        return
    assert all(len(r) == 1 for r in res), outs
    assert res[0] == res[1], res
    want = {"fast_query": "process 0: NCCL reports no GIN backend",
            "fast_init": "process 0: the cross-node GIN communicator could not be created"}[scenario]
    assert res[0][0]["path"] == "xla all_to_all" and res[0][0]["reason"].startswith(want), res
