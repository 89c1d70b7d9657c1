"""Bad arguments to EngramTable.write / fetch / wait on a flat 4-rank group and on a 2 x 2 ("node", "gpu") group of
the same CPU devices: every mistake must be refused with the same message on both (the table checks them once,
before it hands the work to the flat or the hierarchical path), and the tables must stay usable. Prints one JSON
line ``RESULT {"cases": {name: {"flat": message, "hier": message}}, "usable": {...}}``.

Run: python tests/workers/engram_args_check.py   (4 CPU devices in one process)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
    import jax_engram as je
except ModuleNotFoundError:  # run straight from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax_engram as je
from jax_engram import layers as L  # noqa: E402

from _harness import group_meshes  # noqa: E402

R, N, D = 4, 8, 4
devs = jax.devices()[:R]
GROUPS = group_meshes(devs)

# name -> fn(table, storage [N, D] f32, sf [R*N, 1] f32, ids [T, 2] int32) run per rank; the table has one sf pack
CASES = {
    "write_storage_shape": lambda t, s, sf, i: t.write(jnp.concatenate([s, s[:1]]), sf),
    "write_row_offset": lambda t, s, sf, i: t.write(s[:5], sf[:R * 5], row_offset=4),
    "write_storage_dtype": lambda t, s, sf, i: t.write(s.astype(jnp.bfloat16), sf),
    "write_without_sf": lambda t, s, sf, i: t.write(s),
    "write_sf_shape": lambda t, s, sf, i: t.write(s, sf[:-1]),
    "write_sf_dtype": lambda t, s, sf, i: t.write(s, sf.astype(jnp.int32)),
    "fetch_ids_rank": lambda t, s, sf, i: t.wait(t.fetch(i.reshape(-1)))[0],
    "fetch_ids_float": lambda t, s, sf, i: t.wait(t.fetch(i.astype(jnp.float32)))[0],
    "fetch_mode": lambda t, s, sf, i: t.wait(t.fetch(i, mode="wrap"))[0],
    "fetch_sf_layout": lambda t, s, sf, i: t.wait(t.fetch(i, sf_layout="col"))[0],
    "fetch_config": lambda t, s, sf, i: t.wait(t.fetch(i, config={"num_sms": 4}))[0],
    "wait_not_pending": lambda t, s, sf, i: t.wait((i, i))[0],
}


def run(ctx, mesh, axes, table, fn):
    spec = P(axes)
    storage = L.put_global(np.ones((R * N, D), np.float32), ctx, spec)
    sf = L.put_global(np.ones((R * N, 1), np.float32), ctx, P())
    ids = L.put_global(np.zeros((R * 3, 2), np.int32), ctx, spec)
    f = jax.jit(jax.shard_map(lambda s, sf, i: jnp.asarray(fn(table, s, sf, i)).reshape(-1)[:1].astype(jnp.float32),
                              mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec))
    return jax.block_until_ready(f(storage, sf, ids))


results, usable = {}, {}
for shape, (mesh, axes) in GROUPS.items():
    ctx = je.init(mesh, axes, timeout_s=60.0)
    table = je.EngramTable(N, D, jnp.float32, ctx=ctx, num_sf_packs=1)
    for name, fn in CASES.items():
        try:
            run(ctx, mesh, axes, table, fn)
            msg = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            msg = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        results.setdefault(name, {})[shape] = msg
    rows = np.arange(R * N * D, dtype=np.float32).reshape(R * N, D)
    table.write_global(rows, np.arange(R * N, dtype=np.float32)[:, None])
    data, sf = table.lookup_global(np.array([[R * N - 1, 0]], np.int32))
    usable[shape] = bool(np.array_equal(np.asarray(data)[0], np.concatenate([rows[-1], rows[0]]))
                         and np.array_equal(np.asarray(sf)[0], [R * N - 1, 0]))
    ctx.check()
    ctx.close()

print("RESULT " + json.dumps({"cases": results, "usable": usable}), flush=True)
