"""The Engram request plan (ffi/include/jax_engram/engram_gin_plan.h) that the GIN path of a hierarchical
table issues its gets from: checked against a numpy model and against the collective path's bucketing
(jax_engram._scaleout.engram_buckets), so both inter-node paths read the same rows in the same order."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engram import _ffi
from jax_engram._scaleout import engram_buckets

MODES = {"fill": 0, "clip": 1, "checked": 2}


def _plan(ids, mode, E, L, Nn, row_bytes, off):
    p = _ffi.native("cpu").engram_gin_plan(np.asarray(ids, np.int32).ravel().tolist(), MODES[mode], E, L, Nn,
                                            row_bytes, off)
    return {k: np.asarray(v, np.int64) for k, v in p.items()}


def _model(ids, mode, E, L, Nn, row_bytes, off):
    """numpy model: resolve, owner by division, stable grouping by owner rank."""
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
    return {"owner_rank": rank, "owner_node": np.where(ok, rank // L, -1), "owner_local": np.where(ok, rank % L, -1),
            "row": row, "node_local_id": np.where(ok, g % (E * L), -1),
            "remote_offset": np.where(ok, off + row * row_bytes, -1), "peer_count": counts,
            "peer_offset": np.concatenate([[0], np.cumsum(counts)]), "order": order, "slot": slot,
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


def test_plan_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_entries"):
        _ffi.native("cpu").engram_gin_plan([0], 0, 0, 1, 1, 4, 0)
    with pytest.raises(ValueError, match="mode"):
        _ffi.native("cpu").engram_gin_plan([0], 5, 1, 1, 1, 4, 0)


class _FakeNative:
    def __init__(self, support, query):
        self.support, self.query, self.queried = support, query, []

    def gin_support(self):
        return dict(self.support)

    def gin_query(self, ctx_id, ordinal):
        self.queried.append(ordinal)
        return dict(self.query)


class _FakeExchange:
    def allgather(self, name, local, want):
        return {k: local[k] for k in want}


class _FakeInner:
    def __init__(self, native, fail_topology=False):
        self._native, self._exchange, self.id, self.ranks_per_gpu = native, _FakeExchange(), 7, 1
        self.process_ids = [jax.process_index()]
        self.members = [type("M", (), {"ordinal": 0})(), type("M", (), {"ordinal": 1})()]
        self.fail_topology, self.topology_calls = fail_topology, 0

    def nccl_topology(self):
        self.topology_calls += 1
        if self.fail_topology:
            raise RuntimeError("ncclCommInitRankConfig failed")
        return {}


def _fake_ctx(platform, nodes, native, **kw):
    return type("C", (), {"platform": platform, "num_nodes": nodes, "inner": _FakeInner(native, **kw)})()


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
    ctx = _fake_ctx("gpu", 2, _FakeNative(_OK, {"gin_type": 3, "railed_gin_type": 3, "reason": ""}))
    path, reason = g.probe(ctx)
    assert path == g.XLA and "cross-node GIN device communicator is not created" in reason
