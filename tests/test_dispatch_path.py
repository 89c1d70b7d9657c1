"""Jitted functions that call jax_engram ops keep JAX's C++ dispatch path (jax_engram/_call.py, ``_ffi_p``).

JAX runs a jitted function through Python on every call when its program has an effect; a JAX effect on the data
ops would cost every model step that calls them about a millisecond of host time. The ops are effect-free for JAX
and side-effecting custom calls in the HLO (XLA never drops or merges them); a write and a barrier, whose result is
their effect, keep JAX's effect; an overlapped fetch's wait is kept even when its results are unused.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_engram as je
from jax_engram import reference as ref

AX = "ep"


def _mesh():
    return jax.make_mesh((1,), (AX,), devices=jax.devices("cpu")[:1])


def _custom_calls(text: str) -> dict[str, list[str]]:
    """{target: [has_side_effect value per call]} of the lowered StableHLO text."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r'stablehlo\.custom_call @(\w+)\(.*?\)\s*\{(.*?)\}\s*:', text, re.S):
        side = re.search(r"has_side_effect\s*=\s*(\w+)", m.group(2))
        out.setdefault(m.group(1), []).append(side.group(1) if side else "false")
    return out


def test_a_model_step_has_no_jax_effect_and_side_effecting_custom_calls():
    mesh = _mesh()
    ctx = je.init(mesh, AX)
    try:
        rng = np.random.default_rng(0)
        rows = rng.standard_normal((64, 8)).astype(np.float32)
        tab = je.EngramTable(64, 8, jnp.float32, ctx=ctx)
        tab.write_global(rows)
        ids = rng.integers(-1, 64, (16, 3)).astype(np.int32)
        x = rng.standard_normal((16, 32)).astype(np.float32)
        topk = np.stack([np.arange(16) % 4, (np.arange(16) + 1) % 4], 1).astype(np.int32)

        def step(ids, x, topk):
            pend = tab.fetch(ids)                       # overlapped fetch ...
            x = je.start_before(x, pend)
            d = je.dispatch(x, topk, ctx=ctx, num_experts=4, max_tokens_per_rank=16)
            y = je.combine(d.recv_x, d.handle).combined_x
            data, _ = tab.wait(pend, after=y)           # ... its wait after the layer
            looked, _ = tab.lookup(ids)
            return data, looked, y

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(),) * 3, out_specs=(P(),) * 3, check_vma=False))
        assert jax.make_jaxpr(f)(ids, x, topk).effects == set()
        calls = _custom_calls(f.lower(ids, x, topk).as_text())
        for target in ("jax_engram_engram_fetch", "jax_engram_engram_wait"):
            assert calls.get(target) and all(v == "true" for v in calls[target]), (target, calls)
        assert any(t.startswith("jax_engram_ep_") for t in calls), calls
        assert all(v == "true" for t, vs in calls.items() if t.startswith("jax_engram") for v in vs), calls
        data, looked, y = f(ids, x, topk)
        want, _ = ref.engram_lookup(rows.reshape(1, 64, 8), ids)
        np.testing.assert_array_equal(np.asarray(data), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(looked), np.asarray(want))
        # non-expand: each token reaches the only rank once (for both of its experts) and comes back as it went
        np.testing.assert_array_equal(np.asarray(y), x)
    finally:
        ctx.close()


def test_unused_results_drop_reads_but_never_a_wait_a_write_or_a_barrier():
    mesh = _mesh()
    ctx = je.init(mesh, AX)
    try:
        tab = je.EngramTable(64, 8, jnp.float32, ctx=ctx)
        ids = np.zeros((4, 2), np.int32)

        def lowered(body, *a):
            specs = (P(),) * len(a)
            return _custom_calls(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(),
                                                       check_vma=False)).lower(*a).as_text())

        def unused_lookup(i):
            tab.lookup(i)
            return i

        def unused_wait(i):  # the fetch is kept by start_before; its wait must stay (it joins the fetch's stream)
            pend = tab.fetch(i)
            i = je.start_before(i, pend)
            tab.wait(pend)
            return i

        def unused_write(s):
            tab.write(s)
            return s

        def unused_barrier(i):
            je.barrier(ctx=ctx)
            return i

        assert "jax_engram_engram_fetch" not in lowered(unused_lookup, ids)
        calls = lowered(unused_wait, ids)
        assert calls.get("jax_engram_engram_fetch") and calls.get("jax_engram_engram_wait"), calls
        assert "jax_engram_engram_write" in lowered(unused_write, np.zeros((64, 8), np.float32))
        assert "jax_engram_barrier" in lowered(unused_barrier, ids)
        # the write and the barrier keep JAX's effect (their only result is what they do)
        f = jax.jit(jax.shard_map(unused_write, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        assert jax.make_jaxpr(f)(np.zeros((64, 8), np.float32)).effects
    finally:
        ctx.close()


def test_close_waits_for_enqueued_global_calls():
    """lookup_global / write_global return before their program ran (JAX dispatches asynchronously): close() waits
    for them, so results read after close are the rows (not a 'context is closing' failure)."""
    mesh = _mesh()
    ctx = je.init(mesh, AX)
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((1 << 14, 256)).astype(np.float32)
    tab = je.EngramTable(1 << 14, 256, jnp.float32, ctx=ctx)
    tab.write_global(rows)
    sets = [rng.integers(-1, 1 << 14, (1024, 24)).astype(np.int32) for _ in range(12)]
    outs = [tab.lookup_global(ids)[0] for ids in sets]  # enqueued; most have not run yet
    ctx.close()
    for ids, got in zip(sets, outs):
        want = np.where(ids[..., None] >= 0, rows[np.maximum(ids, 0)], 0).reshape(ids.shape[0], -1)
        np.testing.assert_array_equal(np.asarray(got), want)


_CLOSE_RACE = r"""
import sys
import jax
PLATFORM, PLACEMENT = sys.argv[2], sys.argv[3]
if PLATFORM == "cpu":  # two ranks in this process; on a GPU, the one device
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
import numpy as np, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import jax_engram as je
N = len(jax.devices())
mesh = jax.make_mesh((N,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
ctx = je.init(mesh, "ep")
rng = np.random.default_rng(1)
rows = rng.standard_normal((N << 13, 256)).astype(np.float32)
tab = je.EngramTable(1 << 13, 256, jnp.float32, ctx=ctx, placement=PLACEMENT)
tab.write_global(rows)
sets = [rng.integers(-1, N << 13, (1024, 24)).astype(np.int32) for _ in range(12)]
if sys.argv[1] in ("global", "free"):
    outs = [tab.lookup_global(ids)[0] for ids in sets]
else:  # "user" / "user_free": the user's own jitted lookups (each rank its half of the ids)
    f = jax.jit(jax.shard_map(lambda i: tab.wait(tab.fetch(i))[0], mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    sh = jax.sharding.NamedSharding(mesh, P("ep"))
    outs = [f(jax.device_put(ids, sh)) for ids in sets]
if sys.argv[1] in ("free", "user_free"):
    tab.free()  # waits for the table's global calls, like close; a queued user call that starts later fails
if sys.argv[1] == "user_free":  # the context stays usable: a new table, written and read
    t2 = je.EngramTable(1 << 13, 256, jnp.float32, ctx=ctx, placement=PLACEMENT)
    t2.write_global(rows)
    d, _ = t2.lookup_global(sets[0])
    print("AFTER", np.array_equal(np.asarray(d), np.where(sets[0][..., None] >= 0, rows[np.maximum(sets[0], 0)], 0)
                                  .reshape(sets[0].shape[0], -1)), flush=True)
ctx.close()
for ids, got in zip(sets, outs):
    want = np.where(ids[..., None] >= 0, rows[np.maximum(ids, 0)], 0).reshape(ids.shape[0], -1)
    try:
        print("OK" if np.array_equal(np.asarray(got), want) else "WRONG", flush=True)
    except Exception as e:  # noqa: BLE001
        print("ERROR " + str(e).splitlines()[0][-260:], flush=True)
"""


def test_close_with_enqueued_work_waits_or_fails_cleanly():
    """Two ranks in one process, calls enqueued and not waited for, then close() (or the table's free(), then
    close()): the *_global calls are waited for (every result right); the user's own jitted calls either ran or
    fail naming the op and the closing context, or the freed memory -- never a crash (close and free stop every
    local member's use of the memory before freeing any of it: their handlers read each other's windows), and the
    context stays usable after such a free."""
    _close_race("cpu", "device")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("placement", ["device", "host"])
def test_close_with_enqueued_work_waits_or_fails_cleanly_gpu(placement):
    """The same on one GPU (one rank): close() and free() drain the member's streams (and the host path's
    workers) before the memory goes."""
    _close_race("cuda", placement)


def _close_race(platform: str, placement: str):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if platform == "cuda":
        env["JAX_PLATFORMS"] = "cuda"
    for mode in ("global", "free", "user", "user_free"):
        p = subprocess.run([sys.executable, "-c", _CLOSE_RACE, mode, platform, placement], capture_output=True,
                           text=True, timeout=300, env=env)
        assert p.returncode == 0, (mode, p.returncode, p.stdout[-2000:], p.stderr[-3000:])
        lines = p.stdout.splitlines()
        if mode == "user_free":
            assert lines[0] == "AFTER True", (mode, p.stdout)
            lines = lines[1:]
        assert len(lines) == 12, (mode, p.stdout)
        if mode in ("global", "free"):
            assert all(l == "OK" for l in lines), lines
        elif mode == "user":
            # the call ran, or it failed naming the op and the closing (or, once close returned, closed) context
            assert all(l == "OK" or ("jax_engram engram" in l and ("is closing" in l or "(closed" in l))
                       for l in lines), lines
        else:  # the memory was freed under a queued call: it fails naming the freed allocation
            assert all(l == "OK" or ("jax_engram engram" in l and "its memory was freed" in l) for l in lines), lines
