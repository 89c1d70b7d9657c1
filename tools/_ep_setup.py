"""What the EP diagnosis scripts (ep_trace.py, ep_overhead.py) share: DeepEP's config on the first two devices."""
import numpy as np
import jax
from jax.sharding import Mesh

import jax_engram as je

H, K, E = 7168, 8, 256  # hidden, top-k, experts


def setup(tokens_per_rank):
    """(mesh over axis "ep", context, ranks, topk [R, M, K] int32, x [R, M, H] float32) with a fixed seed."""
    devs = jax.devices()[:2]
    R = len(devs)
    mesh = Mesh(np.array(devs), ("ep",))
    ctx = je.init(mesh, "ep")
    rng = np.random.default_rng(0)
    tk = np.argsort(rng.random((R, tokens_per_rank, E)), axis=-1)[..., :K].astype(np.int32)
    x = rng.standard_normal((R, tokens_per_rank, H)).astype(np.float32)
    return mesh, ctx, R, tk, x
