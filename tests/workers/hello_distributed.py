"""Smallest end-to-end check of the multi-process harness.

Launched by ``jax_engram.launch`` (N processes x K devices): joins the jax.distributed job,
builds one global Explicit mesh over all devices of all processes, feeds each process's local
rows through ``jax.make_array_from_process_local_data`` and ``psum``s them inside
``shard_map``.  Process ``r`` contributes ``arange(4*K) + 100*r``, i.e. device ``j`` of
process ``r`` holds ``[4j, 4j+1, 4j+2, 4j+3] + 100*r``, so the psum (shape (4,)) is
``sum_{r,j} (4j + 100r) + [0, 1, 2, 3] * N*K``.

Also runs without the launcher (single process, local devices only).
"""

from _harness import import_launch

launch = import_launch()
cfg = launch.initialize()  # before anything touches a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

n, loc, rank = jax.device_count(), jax.local_device_count(), jax.process_index()
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
local = np.arange(4 * loc, dtype=np.float32) + 100 * rank
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local, (4 * n,))

with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(lambda xl: jax.lax.psum(xl, "x"), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))
    out = f(x)
    psum = np.asarray(out.addressable_data(0))

launch.emit_result({
    "process_index": rank,
    "process_count": jax.process_count(),
    "device_count": n,
    "local_device_count": loc,
    "platform": jax.devices()[0].platform,
    "launched": cfg is not None,
    "psum": psum.tolist(),
})
launch.shutdown()
