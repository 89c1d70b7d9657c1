"""ep_check's arguments, process setup, mesh and helpers (imported first: parses the command line and joins the
launcher's job before anything starts a JAX backend)."""
from __future__ import annotations

import argparse
import time
from functools import partial

from _harness import REPO, Checks, bits, local, same, start  # noqa: F401 (bits, local, same: for the suites)
from _harness import shard as _shard

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto")
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--suite", default="full")
ap.add_argument("--cases", default="")
ap.add_argument("--timeout", type=float, default=120.0)
ap.add_argument("--cuda-graphs", action="store_true", help="create the context with cuda_graphs=True")
ap.add_argument("--ep-config", default="", help="jax_engram.EPConfig fields of every context, e.g. "
                "dispatch_copy_engine=always,copy_engine_pieces=3")
ap.add_argument("--wide-only", action="store_true", help="only the cases marked wide (for 4+ ranks)")
ap.add_argument("--nodes", type=int, default=0, help="hierarchical EP group: a (nodes, R/nodes) mesh with axes "
                "(\"node\", \"gpu\") and je.init(mesh, (\"node\", \"gpu\")) (suites cases, cache, gradne)")
ap.add_argument("--ref-dir", default="", help="share reference results between processes / runs (process 0 "
                "computes, the others wait for its files); default: every process computes its own")
args = ap.parse_args()

launch_cfg = start(args.platform, args.cpu_devices)
from jax_engram import launch  # noqa: E402,F401
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402


def _parse_ep_config(text: str) -> "je.EPConfig":
    kw = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        kw[k] = v if k in ("dispatch_copy_engine", "one_rank") else int(v)
    return je.EPConfig(**kw)


EPC = _parse_ep_config(args.ep_config)
REF_SRC = (REPO / "jax_engram" / "reference.py").read_bytes()  # read with the import: keys the reference cache
from jax_engram import reference as ref  # noqa: E402,F401

checks = Checks(decimals=1)
check = checks.run
results = checks.results
T0 = time.time()

devices = jax.devices()
R = len(devices)
# The EP ops of a flat context of one rank take the local path (jax_engram/_ep_local.py: no dispatch / combine
# handler, no staging region; its guard calls keep the errors): the checks of those handlers do not apply then.
LOCAL = R == 1 and not args.nodes and EPC.one_rank == "local"
if args.nodes:
    AX = ("node", "gpu")
    mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(args.nodes, -1),
                             AX, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
else:
    AX = "ep"
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
SPEC = P(AX)
shard = partial(_shard, mesh=mesh, spec=SPEC)  # global [R, ...] numpy array -> jax array sharded on axis 0
