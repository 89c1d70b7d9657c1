"""The README's quick start: an Engram lookup and an MoE dispatch / combine on 4 devices.

Run: ``JAX_PLATFORMS=cpu python examples/quickstart.py`` (4 CPU devices stand in for 4 GPUs). The lines between
the markers are the README's; the rest checks them against numpy and exits non-zero on a mismatch.
"""
# --- quick start
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_engram as je

jax.config.update("jax_num_cpu_devices", 4)                 # 4 CPU devices stand in for 4 GPUs
mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
ctx = je.init(mesh, "ep")                                   # the EP group: the 4 devices of mesh axis "ep"
rng = np.random.default_rng(0)

# Engram: a table of 4 x 1000 rows of 64 bf16 (rank r holds global ids r*1000..), read by global id
table = je.EngramTable(1000, 64, jnp.bfloat16, ctx=ctx)
rows = rng.standard_normal((4000, 64)).astype(jnp.bfloat16)
table.write_global(rows)
ids = np.array([[3, 2500], [3999, -1]])                     # 2 tokens x 2 ids; -1 = padding (zero row)
data, _ = table.lookup_global(ids)                          # [2, 2 * 64]: the rows of each token side by side

# MoE: 32 tokens (8 per rank) go to their top-2 of 8 experts (2 per rank); the weighted outputs come back summed
def moe(x, topk_idx, topk_weights, w):                      # per rank: x [8, 64], w [2, 64, 64] (its 2 experts)
    res = je.dispatch(x, topk_idx, topk_weights, ctx=ctx, num_experts=8, max_tokens_per_rank=8, expand=True)
    y = jax.lax.ragged_dot(res.recv_x, w, res.group_sizes) * res.recv_topk_weights[:, None]
    return je.combine(y.astype(x.dtype), res.handle).combined_x

x = rng.standard_normal((32, 64)).astype(jnp.bfloat16)
topk_idx = np.argsort(rng.random((32, 8)), axis=1)[:, :2].astype(np.int32)   # 2 distinct experts per token
topk_weights = rng.random((32, 2), np.float32)
w = (rng.standard_normal((8, 64, 64)) / 8).astype(jnp.bfloat16)              # expert e lives on rank e // 2
args = jax.device_put((x, topk_idx, topk_weights, w), NamedSharding(mesh, P("ep")))  # axis 0 split over ranks
out = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)   # [32, 64]
# --- end of quick start

f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
want_data = np.concatenate([np.where(ids[:, k, None] >= 0, f32(rows)[ids[:, k]], 0) for k in range(2)], axis=1)
assert data.shape == (2, 128) and np.array_equal(f32(data), want_data), "Engram lookup differs from numpy"
want = sum(topk_weights[:, k, None] * np.einsum("th,thf->tf", f32(x), f32(w)[topk_idx[:, k]]) for k in range(2))
err = np.max(np.abs(f32(out) - want)) / np.max(np.abs(want))
assert out.shape == (32, 64) and err < 2e-2, f"MoE output differs from numpy: max relative error {err:.3g}"
print(f"PASS quickstart: Engram rows bit-exact, MoE max relative error {err:.2g} (bfloat16)")
ctx.close()
