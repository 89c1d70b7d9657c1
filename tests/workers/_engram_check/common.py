"""engram_check's arguments, process setup, shared context and helpers: table data, ids, the reference result of
a global lookup, bit-exact comparison of global arrays, and the case registry (imported first: parses the command
line and joins the launcher's job before anything starts a JAX backend)."""
from __future__ import annotations

import argparse
import os

from _harness import assert_same, make_ids, random_bits, shard, start  # noqa: F401 (make_ids: for the cases)

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda"],
                help="standalone runs: jax platform (ignored under the launcher, which sets it)")
ap.add_argument("--cpu-devices", type=int, default=4, help="standalone CPU runs: number of CPU devices")
ap.add_argument("--suite", default="full", choices=["full", "core", "quick"])
ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
ap.add_argument("--list", action="store_true")
ap.add_argument("--gather", default="default", choices=["default", "tma", "sm", "sm_few"],
                help="EngramConfig of every table: default, or this gather for fetch and lookup alike")
ap.add_argument("--num-sms", type=int, default=None, help="EngramConfig.num_sms of every table")
ap.add_argument("--host-gather", default="auto", choices=["auto", "cpu", "gpu"],
                help="EngramConfig.host_gather of every table (who moves host-placed rows on a GPU)")
ap.add_argument("--host-threads", type=int, default=0, help="EngramConfig.host_threads of every table")
args = ap.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
cfg = start(args.platform, args.cpu_devices)  # before anything touches a JAX backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import reference  # noqa: E402

AX = "ep"
BF16, F16, F32, FP8 = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32),
                       np.dtype(ml_dtypes.float8_e4m3fn))
DEVS = jax.devices()
R = len(DEVS)
PLATFORM = DEVS[0].platform
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,), devices=DEVS)
ctx = je.init(mesh, AX, timeout_s=120.0)
_cfg_kw = {} if args.gather == "default" else dict(fetch_gather=args.gather, lookup_gather=args.gather)
if args.num_sms is not None:
    _cfg_kw["num_sms"] = args.num_sms
_cfg_kw.update(host_gather=args.host_gather, host_threads=args.host_threads)
CONFIG = je.EngramConfig(**_cfg_kw)
_ref = jax.jit(reference.engram_lookup, static_argnames=("mode", "sf_layout"))



# ------------------------------------------------------------------------------------------- data
def make_table_data(seed, N, H, dt, packs, sf_dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = random_bits(rng, (R * N, H), dt)
    sf = random_bits(rng, (R * N, packs), np.float32).view(sf_dtype) if packs else None
    return x, sf


def reference_lookup(x, sf, ids, N, mode, sf_layout, sharded=True):
    """Reference for the global result of lookup_global: per-rank blocks stacked along axis 0 (sharded) or
    the lookup of all ids (replicated)."""
    H = x.shape[1]
    shards = x.reshape(R, N, H)
    blocks = np.split(ids, R) if sharded else [ids]
    outs = [_ref(shards, b, mode=mode, sf_table=sf, sf_layout=sf_layout) for b in blocks]
    data = np.concatenate([np.asarray(o[0]) for o in outs])
    s = None if sf is None else np.concatenate([np.asarray(o[1]) for o in outs])
    return data, s


def assert_global_equal(got, want, what):
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is None and 'None'} want {want is None and 'None'}"
        return
    assert_same(got, want, what)


def sharded(a):
    return shard(a, mesh, P(AX, None))


def replicated(a):
    return shard(a, mesh, P())


def check_lookups(table, x, sf, seed, T, E, modes=("fill", "clip", "checked"), layouts=("row",)):
    for k, mode in enumerate(modes):
        ids = make_ids(seed + k, R * T, E, table.total_entries, special=(mode != "checked"))
        for layout in layouts:
            data, s = table.lookup_global(sharded(ids), mode=mode, sf_layout=layout)
            want, want_sf = reference_lookup(x, sf, ids, table.num_entries, mode, layout)
            assert_global_equal(data, want, f"data mode={mode} sf_layout={layout}")
            assert_global_equal(s, want_sf, f"sf mode={mode} sf_layout={layout}")


def new_table(N, H, dt, placement, packs=0, sf_dtype=np.float32, c=None, config=None):
    return je.EngramTable(N, H, dt, ctx=c or ctx, placement=placement, num_sf_packs=packs, sf_dtype=sf_dtype,
                          config=config or CONFIG)


# ------------------------------------------------------------------------------------------ cases
CASES = []


def case(name, suites=("full",)):
    def deco(fn):
        CASES.append((name, set(suites), fn))
        return fn
    return deco
