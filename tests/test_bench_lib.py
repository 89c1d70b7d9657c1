"""Fast CPU tests of the benchmark support library (benchmarks/_common.py, _ceilings.py, _baselines.py).

Each scenario runs in a fresh python subprocess with JAX_PLATFORMS=cpu and a forced number of host
devices (so the test does not depend on how jax was configured in the pytest process), prints one
JSON line, and the tests assert on it. Both subprocesses start together at module setup.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")

SCRIPT = textwrap.dedent(r'''
import json, math, os, sys, tempfile
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[1])
import _common as C, _ceilings as K, _baselines as B

res = {}
R = len(jax.devices())
FULL = R > 1   # the 1-device run covers the skip paths and R=1 edge cases with fewer compiles
res["devices"] = R
mesh = C.make_ep_mesh()

# ---------------- _common ----------------
f = jax.jit(lambda a: a * 2 + 1)
x = jnp.arange(1024, dtype=jnp.float32)
t = C.time_fn(f, x, warmup=2, iters=7)
res["time_fn"] = dict(keys=sorted(t), n=len(t["samples"]),
                      ordered=t["p10_us"] <= t["median_us"] <= t["p90_us"], positive=t["median_us"] > 0)
sets = C.rotate(lambda i: (jnp.full((256,), i + 1.0),), 3)
t_rot = C.time_fn(f, arg_sets=sets, warmup=1, iters=6)
res["rotate"] = dict(k=len(sets), distinct=len({float(s[0][0]) for s in sets}), n=len(t_rot["samples"]),
                     k_for_1MiB=C.rotations_for_cache(1 << 20), k_for_1GiB=C.rotations_for_cache(1 << 30))
used = []  # which set each call got: the count runs on from the warm-up, across both timers' own runs
g = lambda a: (used.append(int(a[0])), f(a))[1]  # noqa: E731
C.time_fn(g, arg_sets=sets, warmup=2, iters=4)
res["rotate_time_fn"] = used[:]
used.clear()
tb = C.time_back_to_back(g, arg_sets=sets, steps=2, warmup=1, iters=2)
res["rotate_b2b"] = dict(used=used[:], n=len(tb["samples"]))
calls = []  # (function, set) of every call: the order rotates per sample, every function gets the sample's set
mk = lambda name: lambda a: (calls.append((name, int(a[0]))), f(a))[1]  # noqa: E731
def bad(a):
    calls.append(("bad", int(a[0])))
    raise ValueError("boom")
ti = C.time_interleaved({"a": mk("a"), "b": mk("b"), "bad": bad}, arg_sets=sets, warmup=1, iters=4)
res["interleaved"] = dict(calls=calls[:], n={k: len(v.get("samples", [])) for k, v in ti.items()},
                          error=ti["bad"].get("error"))
calls.clear()
ti = C.time_interleaved({"a": mk("a"), "b": mk("b")}, arg_sets=sets, warmup=1, iters=2, steps=2)
res["interleaved_b2b"] = dict(calls=calls[:], inner=ti["a"]["inner"], n=len(ti["b"]["samples"]))
t_in = C.time_fn(f, x, warmup=1, iters=4, inner=10)
res["inner"] = t_in["inner"]
tl = C.time_loop(lambda c: c * 0.5 + 1.0, x, 50, warmup=1, iters=4)
res["time_loop"] = dict(n=tl["n"], inner=tl["inner"], positive=tl["median_us"] > 0)
tab = C.Table(["name", ("us", "time us"), ("gbps", "GB/s", ".2f")], title="demo")
tab.add(name="a", us=1234.5678, gbps=3.14159).add(name="bb", us=None, gbps=None)
txt = tab.render()
res["table"] = dict(has_title=txt.startswith("demo"), has_na="n/a" in txt, has_fmt="3.14" in txt,
                    has_sep="1,234.6" in txt, lines=len(txt.splitlines()))
C.print_table([dict(what="x", v=1.5)], ["what", "v"])
line = C.config_line(tokens=128, hidden=7168, topk=8, dtype=jnp.bfloat16)
res["config_line"] = line
d = tempfile.mkdtemp()
p = C.write_json(os.path.join(d, "sub", "r.json"), dict(a=np.float32(1.5), b=float("nan"), c=np.arange(3),
                                                         dt=jnp.bfloat16, arr=jnp.ones(2)))
res["json"] = json.load(open(p))
res["units"] = [C.gbps(1e9, 1e6), C.mpps(2e6, 1e6), C.gbps(None, 1.0)]

# ---------------- _ceilings ----------------
ce = K.all_ceilings(1 << 20, mesh=mesh, warmup=1, iters=3)
summ = {}
for k, v in ce.items():
    if "skipped" in v or "error" in v:
        summ[k] = dict(skipped=v.get("skipped"), error=v.get("error"))
    elif k == "p2p_copy":
        summ[k] = dict(verified=v["verified"], one=v["one_way"]["gbps"], bi=v["bidir"]["gbps"])
    elif k == "host_to_device":
        summ[k] = dict(verified=v["verified"], method=v["method"], h2d=v["h2d"]["gbps"], d2h=v["d2h"]["gbps"])
    elif k == "local_d2d":
        summ[k] = dict(verified=v["verified"], copy=v["copy"]["gbps"], kernel=v["kernel"]["rw_gbps"])
    elif k == "all_to_all":
        summ[k] = dict(verified=v["verified"], algbw=v["algbw_gbps"])
res["ceilings"] = summ
C.print_table(K.ceiling_rows(ce), ["what", "median_us", "gbps", "note"])

# ---------------- Engram baselines ----------------
eng = {}
for (rows, hid, T, E, rep) in [(64, 16, 5, 3, False), (37, 8, 1, 4, False), (64, 16, 5, 3, True)][:3 if FULL else 1]:
    table, ids = B.make_engram_inputs(mesh, rows, hid, T, E, seed=rows + T, ids_replicated=rep)
    tag = f"rows{rows}_h{hid}_T{T}_E{E}" + ("_repl" if rep else "")
    eng[tag + "_take"] = B.check_engram_lookup(table, ids, B.gspmd_take(table, ids))["ok"]
    if not rep:
        eng[tag + "_a2a"] = B.check_engram_lookup(table, ids, B.a2a_lookup(table, ids))["ok"]
        # fresh ids, same table (same compiled functions)
        _, ids2 = B.make_engram_inputs(mesh, rows, hid, T, E, seed=rows + T + 100)
        eng[tag + "_a2a_fresh"] = B.check_engram_lookup(table, ids2, B.a2a_lookup(table, ids2))["ok"]
# negative control: a wrong output must fail the check
eng["negative_control_fails"] = not B.check_engram_lookup(table, ids, B.a2a_lookup(table, (ids + 1) % (R * rows)))["ok"]
res["engram"] = eng
res["engram_traffic"] = B.engram_traffic(512, 24, 128, ranks=R)

# ---------------- MoE baselines ----------------
moe = {}
N, H, Kk, E = 12, 32, 4, 8
rag = B.make_ragged_a2a_dispatch_combine(mesh, N, H, Kk, E)
moe["ragged_native"] = dict(supported=rag.supported, reason=rag.reason, check=rag.check())
emu = B.make_ragged_a2a_dispatch_combine(mesh, N, H, Kk, E, impl="emulated")
moe["ragged_emulated"] = [emu.check(), emu.check(fresh_seed=11)]
if FULL:
    emu2 = B.make_ragged_a2a_dispatch_combine(mesh, 7, 16, 2, 4 * R, impl="emulated")  # K < El, odd N
    moe["ragged_emulated_small"] = emu2.check(fresh_seed=3)
cap = B.make_a2a_capacity_dispatch_combine(mesh, N, H, Kk, E)
moe["capacity"] = [cap.check(), cap.check(fresh_seed=12)]
moe["capacity_meta"] = cap.meta
if FULL:
    big = B.make_a2a_capacity_dispatch_combine(mesh, N, H, Kk, E, capacity_factor=float(E))  # never drops
    moe["capacity_nodrop"] = big.check(fresh_seed=4)

# negative controls: a broken dispatch / combine must fail the checks
good_d, good_c = emu.dispatch, emu.combine
emu.dispatch = lambda x, t: (lambda r, g, h: (jnp.roll(r, 1, axis=1), g, h))(*good_d(x, t))
moe["neg_dispatch_fails"] = emu.check()["ok"] is False
emu.dispatch = good_d
emu.combine = lambda y, h, w: good_c(y, h, w[:, ::-1])
moe["neg_combine_fails"] = emu.check()["ok"] is False
emu.combine = good_c
cc = cap.combine
cap.combine = lambda y, h, w: cc(y, h, w * 1.1)
moe["neg_cap_combine_fails"] = cap.check()["ok"] is False
cap.combine = cc

# time_loop over a dispatch+combine round trip (the pattern benchmark scripts use)
x0, tk0, w0 = cap.inputs
def step(c):
    xx, tk, w = c
    recv, gs, h = cap.dispatch(xx, tk)
    return (cap.combine(recv, h, w), tk, w)
tl2 = C.time_loop(step, (x0, tk0, w0), 5, warmup=1, iters=3)
moe["time_loop_roundtrip_us"] = tl2["median_us"]
x1, tk1, w1 = emu.inputs
t3 = C.time_fn(emu.dispatch, x1, tk1, warmup=1, iters=3)
moe["time_fn_dispatch_us"] = t3["median_us"]
moe["ep_traffic"] = B.ep_traffic(tk0, R, E, H * 2)

# deduplicated baselines (each token once per destination rank): bit-exact with the ops' contract
dd = {}
for tag, kw in (("a2a", {}), ("a2a_expand", dict(expand=True)), ("all_gather", dict(impl="all_gather"))):
    bl = B.make_dedup_dispatch_combine(mesh, N, H, Kk, E, **kw)
    dd[tag] = [bl.check(), bl.check(fresh_seed=21)]
ddb = B.make_dedup_dispatch_combine(mesh, N, H, Kk, E)
gd, gc = ddb.dispatch, ddb.combine
ddb.combine = lambda y, h, w: gc(y * 2, h, w)
dd["neg_combine_fails"] = ddb.check()["ok"] is False
ddb.combine = gc
moe["dedup"] = dd

# timing loops: the collectives in their compiled HLO. make_loops (ours' structure) must carry no all-reduce; the
# old chaining of global arrays outside shard_map does (the detector's negative control)
from jax import lax
loops = {}
sf = jnp.ones((x0.shape[0], 2), jnp.float32)
xp = jax.jit(B.pack_rows)(x0.astype(jnp.float8_e4m3fn), sf)   # FP8 rows packed with their scales
for tag, bl in (("capacity", cap), ("ragged_emulated", emu), ("dedup", ddb),
                ("dedup_expand", B.make_dedup_dispatch_combine(mesh, N, H, Kk, E, expand=True, make_inputs=False))):
    d, c = B.make_loops(bl, mesh, 3, H)
    loops[tag] = dict(dispatch=B.hlo_collectives(d, x0, tk0, w0), combine=B.hlo_collectives(c, x0, tk0, w0))
    d8, c8 = B.make_loops(bl, mesh, 2, H, jnp.float8_e4m3fn)
    jax.block_until_ready((d8(xp, tk0, w0), c8(xp, tk0, w0)))
    loops[tag]["fp8_ran"] = True
def chain(a, out):
    return a.at[(0,) * a.ndim].set(out.reshape(-1)[0].astype(a.dtype), out_sharding=jax.typeof(a).sharding)
with jax.set_mesh(mesh):
    old = jax.jit(lambda x, tk: lax.fori_loop(0, 3, lambda i, x: chain(x, cap.dispatch(x, tk)[0]), x))
    loops["old_chain"] = B.hlo_collectives(old, x0, tk0)
moe["loops"] = loops
moe["packed_row"] = [list(xp.shape), str(xp.dtype)]
res["moe"] = moe
print("RESULT_JSON " + json.dumps(res, default=str))
''')


def _spawn(ndev):
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ndev} --xla_backend_optimization_level=0").strip()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT, BENCH], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs():
    procs = {n: _spawn(n) for n in (4, 1)}
    out = {}
    for n, p in procs.items():
        so, se = p.communicate(timeout=300)
        lines = [l for l in so.splitlines() if l.startswith("RESULT_JSON ")]
        assert p.returncode == 0 and lines, f"subprocess ({n} devices) failed rc={p.returncode}\n{so[-3000:]}\n{se[-5000:]}"
        out[n] = dict(res=json.loads(lines[-1][len("RESULT_JSON "):]), stdout=so)
    return out


@pytest.mark.parametrize("ndev", [4, 1])
def test_common(runs, ndev):
    r = runs[ndev]["res"]
    assert r["devices"] == ndev
    tf = r["time_fn"]
    assert tf["n"] == 7 and tf["ordered"] and tf["positive"]
    assert {"median_us", "p10_us", "p90_us", "samples"} <= set(tf["keys"])
    assert r["rotate"]["k"] == 3 and r["rotate"]["distinct"] == 3 and r["rotate"]["n"] == 6
    assert r["rotate"]["k_for_1GiB"] == 2 and r["rotate"]["k_for_1MiB"] > 50
    # sets hold 1.0, 2.0, 3.0: no timed call repeats the set the call before it used
    assert r["rotate_time_fn"] == [1, 2, 3, 1, 2, 3]
    assert r["rotate_b2b"] == dict(used=[1, 2, 3, 1, 2], n=2)
    # time_interleaved: warm-up a, b, bad (which fails and is dropped); then samples 1..4 on sets 2, 3, 1, 2, each
    # running every live function once, the order rotating over the names a, b, bad (a b, b a, a b, a b)
    assert [tuple(c) for c in r["interleaved"]["calls"]] == [("a", 1), ("b", 1), ("bad", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3),
                                         ("a", 1), ("b", 1), ("a", 2), ("b", 2)], r["interleaved"]["calls"]
    assert r["interleaved"]["n"] == dict(a=4, b=4, bad=0) and r["interleaved"]["error"] == "ValueError: boom"
    # back to back (steps=2): a sample is 2 calls on consecutive sets, both functions on the same ones
    assert [tuple(c) for c in r["interleaved_b2b"]["calls"]] == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("a", 3), ("a", 1), ("b", 3),
                                             ("b", 1), ("b", 2), ("b", 3), ("a", 2), ("a", 3)]
    assert r["interleaved_b2b"]["inner"] == 2 and r["interleaved_b2b"]["n"] == 2
    assert r["inner"] == 10
    assert r["time_loop"] == dict(n=50, inner=50, positive=True)
    assert all(r["table"][k] for k in ("has_title", "has_na", "has_fmt", "has_sep")) and r["table"]["lines"] == 5
    line = r["config_line"]
    for s in ("tokens=128", "hidden=7168", "topk=8", "dtype=bfloat16", f"devices={ndev}", "jax=", "device_kind=cpu", "sms="):
        assert s in line, (s, line)
    assert r["json"] == dict(a=1.5, b=None, c=[0, 1, 2], dt="bfloat16", arr=[1.0, 1.0])
    assert r["units"][0] == pytest.approx(1.0) and r["units"][1] == pytest.approx(2.0) and r["units"][2] is None
    assert "config: " in runs[ndev]["stdout"]


@pytest.mark.parametrize("ndev", [4, 1])
def test_ceilings(runs, ndev):
    c = runs[ndev]["res"]["ceilings"]
    assert c["host_to_device"]["verified"] and c["host_to_device"]["h2d"] > 0 and c["host_to_device"]["d2h"] > 0
    assert c["local_d2d"]["verified"] and c["local_d2d"]["copy"] > 0 and c["local_d2d"]["kernel"] > 0
    if ndev >= 2:
        assert c["p2p_copy"]["verified"] and c["p2p_copy"]["one"] > 0 and c["p2p_copy"]["bi"] > 0
        assert c["all_to_all"]["verified"] is True and c["all_to_all"]["algbw"] > 0
    else:
        assert "2 devices" in c["p2p_copy"]["skipped"]
        assert "2 devices" in c["all_to_all"]["skipped"]


@pytest.mark.parametrize("ndev", [4, 1])
def test_engram_baselines(runs, ndev):
    e = runs[ndev]["res"]["engram"]
    assert all(e.values()), e
    assert len(e) == (8 if ndev > 1 else 4)
    tr = runs[ndev]["res"]["engram_traffic"]
    assert tr["rows"] == 512 * 24 and tr["bytes"] == 512 * 24 * 256


@pytest.mark.parametrize("ndev", [4, 1])
def test_moe_baselines(runs, ndev):
    m = runs[ndev]["res"]["moe"]
    # XLA:CPU has no ragged_all_to_all: reported, not crashed
    rn = m["ragged_native"]
    if not rn["supported"]:
        assert "unsupported" in rn["reason"] and rn["check"]["ok"] is None
    else:
        assert rn["check"]["ok"], rn
    for chk in m["ragged_emulated"] + ([m["ragged_emulated_small"]] if ndev > 1 else []):
        assert chk["ok"] and chk["dispatch_mismatches"] == 0 and chk["group_sizes_ok"], chk
        assert chk["combine_rel_err"] < 1e-2
    for chk in m["capacity"] + ([m["capacity_nodrop"]] if ndev > 1 else []):
        assert chk["ok"] and chk["dispatch_mismatches"] == 0 and chk["group_sizes_ok"], chk
    assert sum(c["dropped"] for c in m["capacity"]) > 0   # capacity 1.25 drops something at this size
    if ndev > 1:
        assert m["capacity_nodrop"]["dropped"] == 0
    assert m["capacity_meta"]["capacity"] == 8  # ceil(1.25 * 12*4 / 8)
    assert m["neg_dispatch_fails"] and m["neg_combine_fails"] and m["neg_cap_combine_fails"]
    assert m["time_loop_roundtrip_us"] > 0 and m["time_fn_dispatch_us"] > 0
    for tag, chks in m["dedup"].items():
        if tag.startswith("neg"):
            continue
        for chk in chks:
            assert chk["ok"] and chk["dispatch_mismatches"] == 0 and chk["combine_mismatches"] == 0, (tag, chk)
    assert m["dedup"]["neg_combine_fails"]
    assert m["packed_row"] == [[12 * ndev, 32 + 4 * 2], "uint8"]   # x's bytes then the scales' bytes
    for tag, lp in m["loops"].items():
        if tag == "old_chain":
            continue
        assert lp["fp8_ran"]
        for op in ("dispatch", "combine"):
            assert lp[op]["all-reduce"] == 0, (tag, op, lp)
    if ndev > 1:  # the old loop's partitioner-made all-reduce: what the detector above must see
        assert m["loops"]["old_chain"]["all-reduce"] >= 1, m["loops"]["old_chain"]
        assert m["loops"]["capacity"]["dispatch"]["all-to-all"] >= 1
    tr = m["ep_traffic"]
    assert tr["expanded_bytes"] == 12 * 4 * 64
    if ndev == 1:
        assert tr["physical_bytes"] == 0 and tr["expanded_remote_bytes"] == 0
    else:
        assert 0 < tr["physical_bytes"] <= tr["logical_bytes"] <= tr["expanded_bytes"]


def test_time_per_call_removes_the_fixed_overhead(monkeypatch):
    """time_per_call's slope cancels a per-program fixed cost exactly; T(n2)/n2 does not; a non-positive slope
    (noise larger than the work) falls back to T(n2)/n2 and says so."""
    sys.path.insert(0, BENCH)
    import _common as C

    clock = [0.0]
    monkeypatch.setattr(C.time, "perf_counter", lambda: clock[0])

    def make(fixed_s, per_s):
        def m(n):
            def run(*_):
                clock[0] += fixed_s + n * per_s
                return None
            return run
        return m

    r = C.time_per_call(make(800e-6, 30e-6), (), 10, 30, warmup=1, iters=3)
    assert r["slope_ok"] and r["n1"] == 10 and r["n2"] == 30
    assert r["median_us"] == pytest.approx(30.0)
    assert r["per_call_us_n2"] == pytest.approx((800.0 + 30 * 30.0) / 30)
    flat = C.time_per_call(make(1e-3, 0.0), (), 2, 6, warmup=1, iters=2)
    assert not flat["slope_ok"] and flat["median_us"] == pytest.approx(1000.0 / 6)
    with pytest.raises(ValueError):
        C.time_per_call(make(0.0, 1e-6), (), 5, 5)


def test_llc_bytes_sums_the_top_level_instances(tmp_path):
    """llc_bytes counts each instance of the highest data cache level once (cpus sharing it list it twice), skips
    instruction caches, and says None where sysfs has nothing."""
    sys.path.insert(0, BENCH)
    import _hostside as HS

    def cache(cpu, index, level, kind, size, shared):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, v in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{v}\n")

    for cpu in range(4):
        cache(cpu, 0, 1, "Data", "48K", str(cpu))
        cache(cpu, 1, 1, "Instruction", "32K", str(cpu))
        cache(cpu, 2, 2, "Unified", "2048K", str(cpu))
        cache(cpu, 3, 3, "Unified", "32M", "0-1" if cpu < 2 else "2-3")  # two instances of 32 MiB
    assert HS.llc_bytes(str(tmp_path)) == 64 << 20
    assert HS.llc_bytes(str(tmp_path / "none")) is None


def test_shown_args_keep_no_machine_paths():
    """A results file records --out and --profile by their last component, everything else as given."""
    import argparse
    sys.path.insert(0, BENCH)
    import _common as C

    ns = argparse.Namespace(out="runs/x/model.json", profile="runs/mprof/", T="512", quick=False)
    assert C.shown_args(ns) == dict(out="model.json", profile="mprof", T="512", quick=False)
    assert C.shown_args(argparse.Namespace(out=None, profile=None)) == dict(out=None, profile=None)


def test_bench_ep_cpu_run(tmp_path):
    """bench_ep.py end to end on 2 CPU devices at tiny sizes: every row checked bit-exact, the baselines per dtype
    on the same bytes (FP8 rows packed with their scales), the dedup baselines checked, no all-reduce in any timed
    loop (ours or baselines), one ceiling definition stated, the pre-existing JSON keys kept."""
    out = tmp_path / "ep.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    H, P_sf = 128, 2
    cmd = [sys.executable, os.path.join(BENCH, "bench_ep.py"), "--tokens", "16", "--hidden", str(H), "--topk", "4",
           "--experts", "16", "--scales", str(P_sf), "--loop", "2", "--iters", "1", "--warmup", "1",
           "--baseline-iters", "1", "--sm-sweep", "", "--ceiling-bytes", str(1 << 16), "--loop-hlo",
           "--ragged-device-kernel", "--out", str(out)]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert len(runs) == 4 and all(r["check"]["ok"] for r in runs), [r.get("check") for r in runs]
    assert "correctness checks all passed (4 configs)" in p.stdout
    assert res["loops_with_all_reduce"] == []
    assert "per direction" in res["ceiling_definition"] and "% of ceiling" in p.stdout
    for r in runs:  # old keys stay, new ones added
        for k in ("dispatch_us", "combine_us", "dispatch_pct_ceiling", "dispatch_speedup_vs_best_baseline",
                  "best_baseline_dispatch", "best_baseline_combine", "baseline_dtype", "loop_collectives"):
            assert k in r, k
        assert r["baseline_dtype"] == r["dtype"]
        assert r["loop_collectives"]["dispatch"]["all-reduce"] == 0
    by = res["baselines_by_dtype"]["16"]
    assert set(by) == {"bf16", "fp8"} and res["baselines"]["16"] is not None
    for dn, row_bytes in (("bf16", 2 * H), ("fp8", H + 4 * P_sf)):
        bl = by[dn]
        for key in ("a2a_cap1.25", "dedup_a2a", "dedup_all_gather", "dedup_a2a_expand"):
            assert bl[key]["supported"] and bl[key]["row_bytes"] == row_bytes, (dn, key, bl[key])
            assert bl[key]["loop"] == [2, 6]          # the same loop lengths as ours
        assert not bl["ragged_a2a"]["supported"]      # XLA:CPU: reported, not crashed
        assert "GPU only" in bl["ragged_a2a_device_kernel"]["reason"]
    for key in ("dedup_a2a", "dedup_all_gather", "dedup_a2a_expand"):
        assert by["bf16"][key]["check"]["ok"], by["bf16"][key]["check"]
    nonexp = [r for r in runs if r["layout"] == "nonexpand"]
    exp = [r for r in runs if r["layout"] == "expand"]
    assert all(r["best_baseline_dispatch"] != "dedup_a2a_expand" for r in nonexp)
    assert all(r["best_baseline_dispatch"] in ("ragged_a2a", "a2a_cap1.25", "dedup_a2a_expand") for r in exp)


def test_bench_model_smoke(tmp_path):
    """``python -m jax_engram.bench model --smoke`` on 4 CPU devices: the JSON has every variant for every (T, mode),
    each with a finite positive time or a stated skip, the overheads against ``resident`` and ``none`` where both ran,
    and the table names every variant (plumbing only: no timing is asserted)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = tmp_path / "m"
    p = subprocess.run([sys.executable, "-m", "jax_engram.bench", "model", "--smoke", "--platform", "cpu", "-q",
                        "--out-dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "model.json").read_text())
    assert res["ranks"] == 4 and res["env"]["backend"] == "cpu"
    import math
    variants = ("none", "resident", "lookup[gpu]", "lookup[cpu]", "prefetch[gpu]", "prefetch[cpu]", "take_hbm")
    steps = {(r["variant"], r["T"], r["mode"]): r for r in res["steps"]}
    Ts = sorted({r["T"] for r in res["steps"]})
    assert Ts and {m for _, _, m in steps} == {"fwd", "train"}
    for v in variants:
        for T in Ts:
            for mode in ("fwd", "train"):
                r = steps[(v, T, mode)]
                if r.get("skipped"):
                    assert v.endswith("[cpu]") and "host_gather" in r["skipped"], r
                    continue
                assert "error" not in r, r
                assert math.isfinite(r["ms"]) and r["ms"] > 0, r
                for ref in ("resident", "none"):
                    assert math.isfinite(r[f"vs_{ref}_pct"]), r
        assert v in p.stdout
    assert steps[("resident", Ts[0], "fwd")]["vs_resident_pct"] == 0.0
    assert {r["id_sets"] for r in res["steps"]} == {2}  # --smoke: the steps cycle through two id sets
    for r in res["fetch"]:
        assert r.get("skipped") or (math.isfinite(r["gbps"]) and r["gbps"] > 0), r
    assert res["tables"][0]["rows_per_table"] > 0 and res["config"]["row_bytes"] == 264
    if (out / "model_step.png").exists():  # matplotlib installed
        assert (out / "model_step.png").stat().st_size > 0


def test_bench_engram_sizes_and_procs_smoke(tmp_path):
    """``bench_engram.py --sizes --procs`` at smoke sizes on one CPU device: every size has each runnable host
    path's rate (finite, with its share of the path's best), the host-memory baseline, the CPU-gather ceiling row
    (measured or a stated skip), and every process count of the multi-process gather (plumbing only)."""
    out = tmp_path / "sizes.json"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_engram.py"), "--tiny", "--sizes", "--procs", "1,2",
                        "--out", str(out)], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    import math
    sizes = sorted({r["size_gib"] for r in res["sizes"]})
    assert len(sizes) == 2
    for s in sizes:
        at = {r["impl"]: r for r in res["sizes"] if r["size_gib"] == s}
        r = at["engram lookup (gpu)"]
        assert math.isfinite(r["gbps"]) and r["gbps"] > 0 and 0 < r["pct_own_best"] <= 100 and r["verified"], r
        assert at["jnp.take on pinned_host (compute_on)"].get("gbps"), at
        c = at["ceiling: CPU gather alone"]
        assert c.get("gbps") or c["detail"].get("skipped"), c
    assert max(r["pct_own_best"] for r in res["sizes"] if r.get("pct_own_best")) == 100
    assert [r["processes"] for r in res["procs"]] == [1, 2]
    assert all(r.get("total_gbps") or r.get("skipped") for r in res["procs"]), res["procs"]
    # "at once" means one common window: every process gathered during most of it
    assert all(r.get("skipped") or r["overlap"] > 0.5 for r in res["procs"]), res["procs"]
    assert "summary (issue 27 goal 2" in p.stdout


def test_bench_ep_one_rank_cpu_run(tmp_path):
    """bench_ep.py --one-rank --smoke on one CPU device: every variant timed (ours both layouts, the native kernels
    forced, the plain-JAX permute), the HBM floor and the ratios recorded, ours == native bit for bit; --profile
    records a trace per variant that tools/profile_gaps.py --kernels reads."""
    out = tmp_path / "ep1.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    prof = tmp_path / "prof"
    cmd = [sys.executable, os.path.join(BENCH, "bench_ep.py"), "--one-rank", "--smoke", "--loop", "2", "--iters", "1",
           "--out", str(out), "--profile", str(prof)]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["args"]["out"] == "ep1.json" and res["args"]["profile"] == "prof"  # no machine paths
    traced = sorted(d.name for d in prof.iterdir() if list(d.rglob("perfetto_trace.json.gz")))
    assert traced == ["32x256_native_expand", "32x256_native_non_expand", "32x256_ours_expand",
                      "32x256_ours_non_expand", "32x256_plain_JAX_permute"], traced
    k = subprocess.run([sys.executable, os.path.join(REPO, "tools", "profile_gaps.py"), str(prof / traced[0]),
                        "--kernels", "8"], capture_output=True, text=True, timeout=60)
    assert k.returncode == 0 and "per call (8 calls)" in k.stdout, k.stdout + k.stderr
    variants = {r["variant"] for r in res["one_rank"]}
    assert variants == {"ours expand", "ours non-expand", "native expand", "native non-expand", "plain-JAX permute"}
    assert res["hbm_rw_gbps"] > 0 and all(r["floor_us"] > 0 and r["vs_permute"] > 0 for r in res["one_rank"])
    assert res["checks"] and all(v for c in res["checks"].values() for v in c.values()), res["checks"]
    assert "ours == native in every shape" in p.stdout


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_ep_plot_draws_the_p2p_ceiling_on_gpus_only(tmp_path, backend, monkeypatch):
    """plot_ep draws the same run's P2P copy as a ceiling on GPUs; a CPU run's device_put between CPU devices is no
    such ceiling and is not drawn."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from jax_engram.bench import report

    drawn = []
    orig = Axes.axhline

    def spy(self, y=0, *a, **k):
        drawn.append((y, k.get("label")))
        return orig(self, y, *a, **k)

    monkeypatch.setattr(Axes, "axhline", spy)
    runs = [{"tokens": t, "dtype": "bf16", "layout": "nonexpand", "row_bytes": 128, "remote_rows": 10, "hidden": 64,
             "dispatch_us": 10.0, "combine_us": 12.0, "dispatch_physical_gbps": 1.0, "combine_physical_gbps": 1.0}
            for t in (8, 16)]
    res = {"env": {"backend": backend, "device_kind": backend}, "args": {"hidden": 64, "topk": 2, "experts": 8},
           "ranks": 2, "ceiling": {"one_way": {"gbps": 7.5}}, "runs": runs, "baselines": {}}
    paths = report.plot_ep(res, str(tmp_path))
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    want = [(7.5, "ceiling: P2P copy, one way")] * 2 if backend == "gpu" else []
    assert drawn == want, drawn


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_engram_plot_one_rank_device_panel_is_local_hbm(tmp_path, backend, monkeypatch):
    """At one rank a device table's rows are all local: plot_engram's bandwidth panel shows local GB/s (nonzero)
    against the same run's HBM copy ceiling on GPUs, and no ceiling on CPU."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from jax_engram.bench import report

    drawn, ylabels, plotted = [], [], []
    orig_h, orig_y, orig_p = Axes.axhline, Axes.set_ylabel, Axes.plot
    monkeypatch.setattr(Axes, "axhline", lambda self, y=0, *a, **k: (drawn.append((y, k.get("label"))),
                                                                      orig_h(self, y, *a, **k))[1])
    monkeypatch.setattr(Axes, "set_ylabel", lambda self, s, *a, **k: (ylabels.append(s), orig_y(self, s, *a, **k))[1])
    monkeypatch.setattr(Axes, "plot", lambda self, xs, ys, *a, **k: (plotted.append((k.get("label"), list(ys))),
                                                                      orig_p(self, xs, ys, *a, **k))[1])
    rows = [{"impl": impl, "placement": "device", "hidden": 128, "bytes": b, "us": 10.0}
            for impl in ("engram fetch+wait", "gspmd take") for b in (4096, 65536)]
    res = {"env": {"backend": backend, "device_kind": backend}, "ranks": 1, "args": {"E": 24}, "rows": rows,
           "ceilings": {"local_hbm": {"copy": {"gbps": 3000.0}}}}
    paths = report.plot_engram(res, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["engram_device.png"]
    assert "GB/s read from local HBM" in ylabels, ylabels
    ours = [ys for label, ys in plotted if label == "jax_engram lookup"]
    assert len(ours) == 2 and all(v > 0 for v in ours[1]), plotted  # latency panel, then local GB/s (not zero)
    want = [(3000.0, "ceiling: HBM copy (bytes counted once)")] if backend == "gpu" else []
    assert drawn == want, drawn


FILL_SCRIPT = textwrap.dedent(r'''
import sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_dtypes
sys.path.insert(0, sys.argv[1])
import _common as C
import jax_engram as je

R = len(jax.devices())
mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
sf_map = lambda raw: jnp.abs(raw) * 2.0 ** -70 + 2.0 ** -6
with je.init(mesh, "ep") as ctx:
    N, H, packs, seed = 11, 64, 2, 123
    t = je.EngramTable(N, H, ml_dtypes.float8_e4m3fn, ctx=ctx, placement="host", num_sf_packs=packs)
    C.fill_hashed(t, seed, sf_seed=seed + 1, sf_map=sf_map, slice_bytes=3 * t.row_bytes)  # 3, 3, 3, 2 rows
    whole = np.asarray(C.hashed_rows_fn(R * N, H, t.dtype, seed, None)(np.uint32(0)))
    whole_sf = np.asarray(sf_map(C.hashed_rows_fn(R * N, packs, np.float32, seed + 1, None)(np.uint32(0))))
    ids = np.arange(R * N, dtype=np.int32).reshape(-1, 1)
    data, sf = t.lookup_global(ids)
    assert np.array_equal(np.asarray(data).view(np.uint8), whole.view(np.uint8)), "rows"
    assert np.array_equal(np.asarray(sf), whole_sf), "scale factors"
    at = np.asarray(jax.jit(lambda i: C.hashed_rows_at(i, H, t.dtype, seed))(ids[::-1, 0]))
    assert np.array_equal(at.view(np.uint8), whole[::-1].view(np.uint8)), "hashed_rows_at"
    assert len(np.unique(whole.view(np.uint8).reshape(R * N, -1), axis=0)) == R * N  # no two rows alike
    t.free()
print("FILL_OK", R)
''')


@pytest.mark.parametrize("ndev", [4, 1])
def test_fill_hashed_writes_the_generator_rows_a_slice_at_a_time(ndev):
    """_common.fill_hashed fills a table (FP8 + scale factors) in slices of a few rows per rank: every row and scale
    factor is the whole-table generator's (hashed_rows_fn(...)(0)), and hashed_rows_at gives the same rows by id."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ndev}").strip())
    p = subprocess.run([sys.executable, "-c", FILL_SCRIPT, BENCH], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and f"FILL_OK {ndev}" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
