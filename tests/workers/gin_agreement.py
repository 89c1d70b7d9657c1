"""One process of a GIN probe agreement run (tests/test_engram_gin.py): ``probe`` over a fake 2-node context
whose exchange is a directory shared by the processes, with fake NCCL / GIN answers and delays, so that one
process fails fast while its peer still waits in a collective step. Prints ``RESULT {"path", "reason"}`` or
``RESULT {"error": type, "message"}``.

Run: python tests/workers/gin_agreement.py DIR PROCESS SCENARIO TIMEOUT_S
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    from jax_engram import _scaleout_gin as g
except ModuleNotFoundError:  # run straight from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jax_engram import _scaleout_gin as g
import jax  # noqa: E402

root, me, scenario, T = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
jax.process_index = lambda: me  # this fake job's process index (no jax.distributed here)
OK = {"compiled": True, "build_version": 23203, "runtime_version": 23203, "reason": ""}
GIN = {"gin_type": 3, "railed_gin_type": 3, "reason": ""}
NO_GIN = {"gin_type": 0, "railed_gin_type": 0, "reason": "NCCL reports no GIN backend"}
# The peer's collective steps wait up to their bound (the context timeout, several times) before they return.
SLOW = 1.8 * T


class DirExchange:
    """The context exchange's contract over files: records are never overwritten, every wait is bounded."""

    def __init__(self, timeout_s):
        self.timeout_s = timeout_s

    def _put(self, key, data: bytes):
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{me}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _get(self, key, deadline):
        while time.monotonic() < deadline:
            if (root / key).exists():
                return (root / key).read_bytes()
            time.sleep(0.01)
        return None

    def allgather(self, name, local, want, *, timeout_s=None):
        for k, v in local.items():
            self._put(f"{name}/{k}", json.dumps(v).encode())
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        out = dict(local)
        for k in want:
            if k not in out:
                got = self._get(f"{name}/{k}", deadline)
                if got is None:
                    raise TimeoutError(f"jax_engram exchange '{name}': no record from [{k!r}]")
                out[k] = json.loads(got)
        return out

    def broadcast_bytes(self, name, value, root_process):
        if me == root_process:
            self._put(name, value)
            return value
        got = self._get(name, time.monotonic() + self.timeout_s)
        if got is None:
            raise TimeoutError(f"jax_engram: process {root_process} did not publish '{name}'")
        return got


class Native:
    def gin_support(self):
        return dict(OK)

    def gin_query(self, ctx_id, ordinal):
        # fast_query: process 0 finds no GIN at once (its local ginType check); the peer has it
        return dict(NO_GIN if scenario == "fast_query" and me == 0 else GIN)

    def nccl_unique_id(self):
        return b"u" * 128

    def gin_init(self, ctx_id, members, nranks, uid, staging_bytes):
        if scenario == "fast_init" and me == 0:
            raise RuntimeError("ncclDevCommCreate(GIN) failed")
        if scenario == "fast_init":
            time.sleep(SLOW)

    def gin_release(self, ctx_id, ordinal):
        pass


class Device:
    def __init__(self, p):
        self.id, self.process_index = 10 + p, p


class Inner:
    def __init__(self):
        self._native, self._exchange, self.id, self.ranks_per_gpu = Native(), DirExchange(T), 7, 1
        self.timeout_s, self.process_ids = T, [0, 1]
        self.members = [type("M", (), {"ordinal": 0, "device": Device(me), "group": 0})()]

    def nccl_topology(self):
        if scenario == "dead" and me == 1:
            os._exit(0)  # this process dies in the collective step: its peer must not wait forever
        if scenario == "fast_query" and me == 1:
            time.sleep(SLOW)  # still waiting in the collective registration when process 0 has its answer
        return {}


mesh = type("Mesh", (), {"axis_names": ("node", "gpu"), "shape": {"node": 2, "gpu": 1},
                         "devices": np.array([[Device(0)], [Device(1)]], dtype=object)})()
ctx = type("C", (), {"platform": "gpu", "num_nodes": 2, "inner": Inner(), "mesh": mesh, "node_axes": ("node",),
                     "local_axis": "gpu", "axis_name": ("node", "gpu"), "local_size": 1, "num_ranks": 2, "id": 7})()
try:
    path, reason = g.probe(ctx)
    print("RESULT " + json.dumps({"path": path, "reason": reason}), flush=True)
except Exception as e:  # noqa: BLE001 - the test compares what every process got
    print("RESULT " + json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
