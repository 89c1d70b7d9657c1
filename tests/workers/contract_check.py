"""The user-facing contract on CPU devices, one case per run (``--case``), printing ``PASS name`` per check and
exiting non-zero on the first failure.

* ``mesh``: every op of a flat context (axis "x", 4 devices) and of a hierarchical ("node", "gpu") one (2 x 2)
  runs in a shard_map over the context's mesh, and refuses, when the function is lowered, a mesh with the same
  axes and sizes but the devices in another order; an op in a shard_map that is not jitted is refused too.
* ``error``: one failing call (``--error``: bad routing, checked lookup, validate_routing, each ``--where``: jit,
  global, check) whose exception the parent test inspects (type, message, nothing printed at exit).

Run: python tests/workers/contract_check.py --case mesh
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--case", required=True, choices=["mesh", "error"])
ap.add_argument("--error", choices=["routing", "checked", "validate_routing"])
ap.add_argument("--where", choices=["jit", "global", "check"], default="jit")
args = ap.parse_args()

os.environ["JAX_PLATFORMS"] = "cpu"
try:
    import jax_engram as je
except ModuleNotFoundError:  # run straight from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax_engram as je
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

DEVS = jax.devices()
N, H, E, ENTRIES = 4, 8, 4, 8


def expect_error(fn, *needles, exc=ValueError):
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"message lacks {missing}: {msg}"
        return msg
    raise AssertionError(f"no {exc.__name__} raised (wanted one naming {needles})")


def mesh_case(axes, good, bad_meshes):
    spec = P(axes)
    ctx = je.init(good, axes)
    x = jnp.arange(4 * N * H, dtype=jnp.float32).reshape(4 * N, H)
    idx = jnp.tile(jnp.array([[0], [1], [0], [1]], jnp.int32), (4, 1))  # every rank sends 2 rows to experts 0, 1
    table = np.arange(4 * ENTRIES * H, dtype=np.float32).reshape(4 * ENTRIES, H)
    tab = je.EngramTable(ENTRIES, H, jnp.float32, ctx=ctx)
    tab.write_global(table)
    ids = jnp.array([[3], [17], [30], [9], [0], [31], [12], [20]], jnp.int32)
    handle_shape = {}

    def disp(x, i):
        r = je.dispatch(x, i, ctx=ctx, num_experts=E, max_tokens_per_rank=N)
        leaves, handle_shape["tree"] = jax.tree.flatten(r.handle)
        handle_shape["avals"] = [jax.typeof(v) for v in leaves]
        return r.num_recv_tokens.reshape(1)

    def comb(y):  # combine alone, with a handle of the right structure (its contents never run)
        handle = jax.tree.unflatten(handle_shape["tree"], [jnp.zeros(a.shape, a.dtype) for a in handle_shape["avals"]])
        return je.combine(y, handle).combined_x

    cases = {
        "dispatch": (disp, (x, idx)),
        "combine": (comb, (jnp.zeros((4 * 4 * N, H), jnp.float32),)),
        "EngramTable.fetch": (lambda i: tab.wait(tab.fetch(i))[0], (ids,)),
        "EngramTable.lookup": (lambda i: tab.lookup(i)[0], (ids,)),
        "EngramTable.write": (lambda s: tab.write(s).reshape(1), (jnp.asarray(table),)),
    }

    def run(f, a, mesh, jit=True):
        sm = jax.shard_map(f, mesh=mesh, in_specs=tuple(spec for _ in a), out_specs=spec)
        return np.asarray((jax.jit(sm) if jit else sm)(*a))

    # The context's own mesh: the results are right (rank 0 holds expert 0, rank 1 expert 1: 8 rows each).
    np.testing.assert_array_equal(run(*cases["dispatch"], good), [8, 8, 0, 0])
    np.testing.assert_array_equal(run(*cases["EngramTable.lookup"], good), table[np.asarray(ids)[:, 0]])
    np.testing.assert_array_equal(run(*cases["EngramTable.fetch"], good), table[np.asarray(ids)[:, 0]])
    run(*cases["EngramTable.write"], good)
    print(f"PASS {axes} same mesh", flush=True)
    op_of = {"EngramTable.lookup": "EngramTable.fetch"}  # lookup is fetch + wait
    for bad_name, bad in bad_meshes.items():
        want = [str(int(d.id)) for d in np.asarray(bad.devices).flat][:1]
        for name, (f, a) in cases.items():
            msg = expect_error(lambda: run(f, a, bad), f"jax_engram.{op_of.get(name, name)}:",
                               "does not place the devices", "the context's group has devices", *want)
            print(f"PASS {axes} {bad_name} {name}: {msg}", flush=True)
    for name, (f, a) in cases.items():
        if name != "combine":
            expect_error(lambda: run(f, a, good, jit=False), "not under jax.jit")
    print(f"PASS {axes} eager shard_map refused", flush=True)
    ctx.close()


if args.case == "mesh":
    flat = Mesh(np.array(DEVS), ("x",))
    mesh_case("x", flat, {"reversed": Mesh(np.array(DEVS[::-1]), ("x",)),
                          "rotated": Mesh(np.roll(np.array(DEVS), 1), ("x",))})
    grid = np.array(DEVS).reshape(2, 2)
    mesh_case(("node", "gpu"), Mesh(grid, ("node", "gpu")),
              {"nodes swapped": Mesh(grid[::-1], ("node", "gpu")), "gpus swapped": Mesh(grid[:, ::-1], ("node", "gpu"))})


def error_case(kind: str, where: str):
    """One failing call; prints ``RAISED <type> :: <message>`` for the exception the user sees, then, for
    where="check", what ``ctx.check()`` raises after the jitted call failed (``RAISED nothing``: nothing)."""
    mesh = Mesh(np.array(DEVS), ("x",))
    ctx = je.init(mesh, "x", timeout_s=10)
    x = jnp.ones((4 * N, H), jnp.float32)
    bad = jnp.tile(jnp.array([[0], [1], [7], [1]], jnp.int32), (4, 1))  # expert 7 of 4, at token 2 of each rank

    def run(f, *a):
        sm = jax.shard_map(f, mesh=mesh, in_specs=tuple(P("x") for _ in a), out_specs=P("x"))
        return jax.block_until_ready(jax.jit(sm)(*a))

    tab = je.EngramTable(ENTRIES, H, jnp.float32, ctx=ctx)
    tab.write_global(np.ones((4 * ENTRIES, H), np.float32))
    calls = {
        "routing": lambda: run(lambda x, i: je.dispatch(x, i, ctx=ctx, num_experts=E, max_tokens_per_rank=N)
                               .num_recv_tokens.reshape(1), x, bad),
        "validate_routing": lambda: run(lambda x, i: je.dispatch(x, i, ctx=ctx, num_experts=E, max_tokens_per_rank=N,
                                                                 validate_routing=True).num_recv_tokens.reshape(1),
                                        x, bad),
        "checked": lambda: run(lambda i: tab.lookup(i, mode="checked")[0], jnp.full((8, 1), 99, jnp.int32)),
    }
    if where == "global":
        calls["checked"] = lambda: tab.lookup_global(np.full((8, 1), 99, np.int32), mode="checked")
    for step in (calls[kind], ctx.check) if where == "check" else (calls[kind],):
        try:
            step()
            print("RAISED nothing", flush=True)
        except Exception as e:  # noqa: BLE001 - the test inspects the type
            print(f"RAISED {type(e).__module__}.{type(e).__name__} :: {' | '.join(str(e).splitlines())}", flush=True)
    if kind != "routing":  # the context stays usable: a good call after the failed one
        np.testing.assert_array_equal(tab.lookup_global(np.array([[1], [31]], np.int32))[0], np.ones((2, H), np.float32))
    print("END", flush=True)


if args.case == "error":
    error_case(args.error, args.where)
