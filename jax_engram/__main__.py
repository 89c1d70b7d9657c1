"""`python -m jax_engram`: the workload jax_engram exists for, on whatever this machine has.

An Engram-augmented MoE block, forward and backward, over an expert-parallel (EP) group of every device:

1. Engram: per token, hashed 2- and 3-gram ids (several hash heads per order) are looked up in one table
   sharded over the EP group (``placement="host"`` by default), prefetched at the start of the step and waited
   for at the layer (``engram_prefetch``, ``pending=``); the rows, concatenated, are gated into the
   hidden state (``h = x + sigmoid(<rms(x), rms(m W_k)> / sqrt(H)) * m W_v``).
2. MoE on h: router top-k, expand dispatch, expert GEMMs with ``jax.lax.ragged_dot``, combine; the block
   returns ``h + moe(h)``.

It checks the block's output and its gradients (x, every parameter) against the pure-JAX twins of the layers
(:mod:`jax_engram.reference`), then times the stages (Engram, dispatch, expert GEMMs, combine, backward) and
prints the configuration and a table (``--json``: one JSON object on stdout instead). Exit status 0 only if
the check passes.

    python -m jax_engram                       # GPUs if jax sees any, else 4 CPU devices in this process
    python -m jax_engram --cpu-devices 1       # one device
    python -m jax_engram -n 2                  # 2 processes (jax.distributed, via jax_engram.launch)
    python -m jax_engram --platform gpu --json

The machine diagnosis (versions, windows, topology, a barrier round trip) is ``python -m jax_engram.diagnose``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
import time
from typing import Any

STAGES = ("engram_lookup", "dispatch", "expert_gemms", "combine", "backward")
STAGE_TITLES = {"engram_lookup": "Engram lookup (hash, fetch, gate)", "dispatch": "dispatch (route + expand)",
                "expert_gemms": "expert GEMMs (ragged_dot)", "combine": "combine", "backward": "backward"}

# (cpu, gpu) defaults of the size flags
_DEFAULTS = {
    "seqs_per_rank": (2, 4), "seq_len": (32, 1024), "hidden": (64, 2048), "ffn": (128, 1024),
    "experts_per_rank": (2, 8), "top_k": (2, 4), "memory_dim": (16, 64), "heads_per_order": (2, 4),
    "buckets_per_head": (1024, 1 << 18), "iters": (20, 20), "warmup": (2, 3), "dtype": ("float32", "bfloat16"),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_engram", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Size flags default to a small block on CPU and a large one on GPUs.")
    p.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                   help="auto: GPUs if jax sees any, else CPU")
    p.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process on the CPU platform")
    p.add_argument("-n", "--processes", type=int, default=1,
                   help="run as N processes of one jax.distributed job (launched through jax_engram.launch)")
    p.add_argument("--gpus-per-process", type=int, default=1, help="with -n on GPUs: GPUs each process owns")
    g = p.add_argument_group("sizes (per rank)")
    g.add_argument("--seqs-per-rank", type=int, help="sequences per rank")
    g.add_argument("--seq-len", type=int, help="tokens per sequence")
    g.add_argument("--hidden", type=int)
    g.add_argument("--ffn", type=int, help="expert intermediate size")
    g.add_argument("--experts-per-rank", type=int)
    g.add_argument("--top-k", type=int)
    g.add_argument("--expert-alignment", type=int, default=8)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="activations (the combine runs in it)")
    g.add_argument("--orders", default="2,3", help="Engram n-gram orders")
    g.add_argument("--heads-per-order", type=int)
    g.add_argument("--buckets-per-head", type=int, help="table rows each hash head addresses")
    g.add_argument("--memory-dim", type=int, help="elements per table row")
    g.add_argument("--placement", choices=["host", "device"], default="host", help="where the table lives")
    p.add_argument("--iters", type=int, help="timed iterations per program")
    p.add_argument("--warmup", type=int, help="untimed iterations per program after compiling")
    p.add_argument("--no-check", action="store_true", help="skip the check against the pure-JAX reference")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=120.0, help="the context's timeout_s (every wait is bounded)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _fill_defaults(a: argparse.Namespace, gpu: bool) -> None:
    for k, v in _DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, v[1] if gpu else v[0])


# ------------------------------------------------------------------------------------------ progress
class _Progress:
    """A tqdm bar on stderr (shown on a terminal, quiet in logs), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="jax_engram", unit="step", file=sys.stderr, leave=False,
                                disable=None, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, what: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------- the job
@dataclasses.dataclass(frozen=True)
class _Shape:
    """The job's figures, derived once from the arguments and the devices."""
    ranks: int
    num_experts: int
    sequences: int
    seq_len: int
    hidden: int
    tokens_per_rank: int
    num_entries: int


def run_job(a: argparse.Namespace) -> dict[str, Any]:
    """Build, check and time the block on this process's view of the job; returns the result dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_engram as je
    from jax_engram import layers as L

    devices = jax.devices()
    platform = devices[0].platform
    if a.platform == "gpu" and platform != "gpu":
        raise SystemExit("jax_engram: --platform gpu but jax sees no GPU")
    _fill_defaults(a, platform == "gpu")
    R = len(devices)
    hashing = L.EngramHashing(orders=tuple(int(n) for n in a.orders.split(",")), heads_per_order=a.heads_per_order)
    shape = _Shape(ranks=R, num_experts=a.experts_per_rank * R, sequences=a.seqs_per_rank * R, seq_len=a.seq_len,
                   hidden=a.hidden, tokens_per_rank=a.seqs_per_rank * a.seq_len,
                   num_entries=-(-(a.buckets_per_head * hashing.num_heads) // R))
    config = _job_config(a, devices, shape, hashing, jnp.dtype(a.dtype))
    n_programs = 5
    prog = _Progress(1 + (0 if a.no_check else 1) + n_programs * (1 + a.warmup + a.iters),
                     enabled=jax.process_index() == 0 and not a.no_progress and jax.process_count() == 1)

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    ctx = je.init(mesh, "ep", timeout_s=a.timeout)
    try:
        job = _build(a, ctx, shape, hashing, jnp.dtype(a.dtype))
        prog.step("table written")
        check: dict[str, Any] = {"skipped": True}
        ok = True
        if not a.no_check:
            check = _check(a, job, shape, hashing)
            ok = check["ok"]
            prog.step("checked against the reference")
        programs = _stage_programs(a, ctx, mesh, job, shape, hashing)
        compile_s, times = _time_programs(a, programs, prog)
        ctx.check()
    finally:
        prog.close()
        ctx.close()

    cum = [times[s] for s in ("engram_lookup", "dispatch", "expert_gemms", "combine", "backward")]
    # A stage's time is its prefix program's minus the previous prefix's; below the timing noise (a few us of
    # launch jitter on small CPU blocks) the difference can come out <= 0: reported as 0 with below_noise.
    stages = {s: c - p for s, c, p in zip(STAGES, cum, [0.0] + cum[:-1])}
    return {"ok": bool(ok), "platform": platform, "config": config, "check": check,
            "stages": {s: {"ms": round(max(stages[s], 0.0), 4), "cumulative_ms": round(c, 4),
                           "below_noise": stages[s] <= 0.0} for s, c in zip(STAGES, cum)},
            "totals": {"forward_ms": round(times["combine"], 4), "step_ms": round(times["backward"], 4)},
            "compile_s": {k: round(v, 3) for k, v in compile_s.items()}}


def _job_config(a: argparse.Namespace, devices, shape: _Shape, hashing, dtype) -> dict[str, Any]:
    """The job's configuration as the result reports it."""
    import jax

    return {
        "platform": devices[0].platform, "devices": shape.ranks, "processes": jax.process_count(),
        "ranks": shape.ranks, "device_kind": devices[0].device_kind, "tokens_per_rank": shape.tokens_per_rank,
        "sequences": shape.sequences, "seq_len": shape.seq_len, "hidden": shape.hidden, "ffn": a.ffn,
        "num_experts": shape.num_experts, "experts_per_rank": a.experts_per_rank, "top_k": a.top_k,
        "expert_alignment": a.expert_alignment, "dtype": dtype.name, "orders": list(hashing.orders),
        "heads_per_order": hashing.heads_per_order, "ids_per_token": hashing.num_heads,
        "buckets_per_head": a.buckets_per_head, "memory_dim": a.memory_dim, "table_dtype": "bfloat16",
        "table_rows": shape.ranks * shape.num_entries, "placement": a.placement, "iters": a.iters,
        "warmup": a.warmup,
    }


@dataclasses.dataclass
class _Built:
    """The job's data (host copies for the reference), its table, the global arrays and the training step."""
    host: dict[str, Any]
    table: Any
    params: dict[str, Any]
    x: Any
    ids: Any
    ct: Any
    step: Any


def _build(a: argparse.Namespace, ctx, shape: _Shape, hashing, dtype) -> _Built:
    """The same data on every process, the Engram table written, and the step: prefetch at its start, the Engram
    layer then the MoE layer, forward and backward (vjp with the cotangent ct)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_engram as je
    from jax_engram import layers as L

    B, S, H = shape.sequences, shape.seq_len, shape.hidden
    ke, km = jax.random.split(jax.random.key(a.seed))
    rng = np.random.default_rng(a.seed)
    host = {
        "x": rng.standard_normal((B, S, H)).astype(np.float32).astype(dtype),
        "ids": rng.integers(0, 32000, (B, S), dtype=np.int32),
        "ct": rng.standard_normal((B, S, H)).astype(np.float32).astype(dtype),
        "rows": (rng.standard_normal((shape.ranks * shape.num_entries, a.memory_dim)) * 0.5).astype(jnp.bfloat16),
        "engram": jax.tree.map(np.asarray, L.init_engram_params(ke, hidden=H, memory_dim=a.memory_dim,
                                                                num_heads=hashing.num_heads)),
        "moe": jax.tree.map(np.asarray, L.init_moe_params(km, hidden=H, ffn=a.ffn, num_experts=shape.num_experts)),
    }
    table = je.EngramTable(shape.num_entries, a.memory_dim, jnp.bfloat16, ctx=ctx, placement=a.placement)
    jax.block_until_ready(table.write_global(host["rows"]))

    ax = ctx.axis_name
    put = lambda v, spec: L.put_global(v, ctx, spec)  # noqa: E731
    moe_specs = L.moe_param_specs(host["moe"], ctx)
    params = {"engram": {k: put(v, P()) for k, v in host["engram"].items()},
              "moe": {k: put(v, moe_specs[k]) for k, v in host["moe"].items()}}
    layer_kw = dict(top_k=a.top_k, expert_alignment=a.expert_alignment)

    def block(p, x, pending):
        h = je.engram_layer(p["engram"], x, table=table, hashing=hashing, pending=pending)  # waits after x
        return h + je.moe_layer(p["moe"], h, ctx=ctx, **layer_kw)

    def step(p, x, ids, ct):
        pending = je.engram_prefetch(table, ids, hashing=hashing)  # at step start: the ids need only the tokens
        x = je.start_before(x, pending)  # issued before the work that consumes x
        out, vjp = jax.vjp(lambda p, x: block(p, x, pending), p, x)
        return out, vjp(ct)

    return _Built(host, table, params, put(host["x"], P(ax)), put(host["ids"], P(ax)), put(host["ct"], P(ax)),
                  step)


def _check(a: argparse.Namespace, job: _Built, shape: _Shape, hashing) -> dict[str, Any]:
    """The step's output and every gradient against the pure-JAX twins of the layers, on one local device."""
    import jax
    import jax.numpy as jnp

    from jax_engram import layers as L

    h_ = job.host
    layer_kw = dict(top_k=a.top_k, expert_alignment=a.expert_alignment)
    out, (gp, gx) = jax.jit(job.step)(job.params, job.x, job.ids, job.ct)

    def ref_block(p, x, ids):
        h = L.engram_layer_reference(p["engram"], x, ids, table_rows=h_["rows"], num_ranks=shape.ranks,
                                     hashing=hashing)
        return h + L.moe_layer_reference(p["moe"], h, num_ranks=shape.ranks, **layer_kw)

    def ref_step(p, x, ids, ct):
        o, vjp = jax.vjp(lambda p, x: ref_block(p, x, ids), p, x)
        return o, vjp(ct)

    with jax.default_device(jax.local_devices()[0]):  # the whole reference on one local device
        r_out, (r_gp, r_gx) = jax.jit(ref_step)({"engram": h_["engram"], "moe": h_["moe"]}, h_["x"], h_["ids"],
                                                h_["ct"])
    tol_f, tol_g = (1e-4, 1e-4) if jnp.dtype(a.dtype) == jnp.float32 else (2e-2, 5e-2)
    errs = {"forward": _rel_err(out, r_out), "d_x": _rel_err(gx, r_gx)}
    for grp in ("engram", "moe"):
        for k in gp[grp]:
            errs[f"d_{grp}.{k}"] = _rel_err(gp[grp][k], r_gp[grp][k])
    bad = {k: v for k, v in errs.items() if not v <= (tol_f if k == "forward" else tol_g)}
    check = {"skipped": False, "ok": not bad, "max_rel_err": errs, "tolerance": {"forward": tol_f, "gradients": tol_g}}
    if bad:
        check["failed"] = sorted(bad)
    return check


def _stage_programs(a: argparse.Namespace, ctx, mesh, job: _Built, shape: _Shape, hashing) -> list:
    """(name, function, arguments) of the timed programs: the block's prefixes up to each stage (Engram lookup,
    dispatch, expert GEMMs, combine), then the whole training step."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_engram as je
    from jax_engram import layers as L

    ax, H, table = ctx.axis_name, shape.hidden, job.table
    specs = ({"engram": {k: P() for k in job.host["engram"]}, "moe": L.moe_param_specs(job.host["moe"], ctx)},
             P(ax), P(ax))

    def prefix(upto: str):
        def body(p, x, ids):
            pending = L.engram_prefetch(table, ids, hashing=hashing)
            h = L.engram_local(p["engram"], x, table=table, hashing=hashing, pending=pending)
            if upto == "engram_lookup":
                return h
            hf = h.reshape(-1, H)
            pm = p["moe"]
            idx, w = L.route(pm["router"], hf, a.top_k)
            res = je.dispatch(hf, idx, w, ctx=ctx, num_experts=shape.num_experts,
                              max_tokens_per_rank=shape.tokens_per_rank, expand=True,
                              expert_alignment=a.expert_alignment, zero_padding=True)
            if upto == "dispatch":
                return res.recv_x
            y = L.moe_experts(res.recv_x, pm["w_up"], pm["w_down"], res.group_sizes)
            y = y * res.recv_topk_weights[:, None]
            if upto == "expert_gemms":
                return y
            return h + je.combine(y.astype(hf.dtype), res.handle).combined_x.reshape(h.shape)

        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(ax))

    stage_args = (job.params, job.x, job.ids)
    programs = [(s, prefix(s), stage_args) for s in ("engram_lookup", "dispatch", "expert_gemms", "combine")]
    # prefetch, je.engram_layer + je.moe_layer, forward + backward
    programs.append(("backward", job.step, (job.params, job.x, job.ids, job.ct)))
    return programs


def _time_programs(a: argparse.Namespace, programs: list, prog: "_Progress") -> tuple[dict, dict]:
    """Compiles every program, then times them in rounds over every program (not one program after another), so
    that a change of the machine's load shifts all of them alike; a program's time is its best round (ms)."""
    import jax
    import numpy as np

    compile_s, compiled = {}, {}
    for name, fn, args in programs:
        prog.step(f"compiling {name}", 0)
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*args).compile()
        compile_s[name] = time.perf_counter() - t0
        prog.step(f"compiled {name}")
    ts: dict[str, list[float]] = {name: [] for name, _, _ in programs}
    for it in range(a.warmup + a.iters):
        for name, _, args in programs:
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            if it >= a.warmup:
                ts[name].append(time.perf_counter() - t0)
            prog.step(f"{'warming up' if it < a.warmup else 'timing'} {name}")
    return compile_s, {name: float(np.min(v)) * 1e3 for name, v in ts.items()}


def _rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref| over this process's shards of ``ours`` (ref: the full host value)."""
    import numpy as np

    ref = np.asarray(ref, np.float32)
    scale = max(float(np.abs(ref).max()), 1e-12)
    err = 0.0
    for sh in ours.addressable_shards:
        d = np.abs(np.asarray(sh.data, np.float32) - ref[sh.index])
        err = max(err, float(d.max()) if d.size else 0.0)
    return err / scale


# ------------------------------------------------------------------------------------------- output
def format_table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = ["jax_engram main job: Engram-augmented MoE block, forward and backward"]
    rows = [
        ("platform", f"{c['platform']} ({c['device_kind']}), {c['devices']} device(s) in {c['processes']} "
                     f"process(es) = {c['ranks']} EP ranks"),
        ("tokens", f"{c['sequences']} sequences x {c['seq_len']} = {c['sequences'] * c['seq_len']} "
                   f"({c['tokens_per_rank']} per rank), hidden {c['hidden']}, {c['dtype']}"),
        ("Engram", f"orders {tuple(c['orders'])} x {c['heads_per_order']} hash heads = {c['ids_per_token']} ids per "
                   f"token; table {c['table_rows']} rows x {c['memory_dim']} {c['table_dtype']}, "
                   f"placement={c['placement']!r}"),
        ("MoE", f"{c['num_experts']} experts ({c['experts_per_rank']} per rank), top-{c['top_k']}, ffn "
                f"{c['ffn']}, expert alignment {c['expert_alignment']}"),
    ]
    w = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{w}}  {v}" for k, v in rows]
    ck = res["check"]
    if ck.get("skipped"):
        lines.append("  check     skipped (--no-check)")
    else:
        worst = max(ck["max_rel_err"].items(), key=lambda kv: kv[1])
        lines.append(f"  check vs pure-JAX reference: forward max rel err {ck['max_rel_err']['forward']:.1e}, "
                     f"worst gradient {worst[0]} {worst[1]:.1e} -> {'PASS' if ck['ok'] else 'FAIL'}")
        if not ck["ok"]:
            lines.append("    failed: " + ", ".join(f"{k}={ck['max_rel_err'][k]:.2e}" for k in ck["failed"]))
    tw = max(len(t) for t in STAGE_TITLES.values())
    lines.append("")
    lines.append(f"  {'stage':<{tw}}  {'ms':>9}  {'cumulative':>10}   (best of {c['iters']}; a stage = its prefix "
                 "program minus the previous one)")
    for s in STAGES:
        st = res["stages"][s]
        ms = "  < noise" if st["below_noise"] else f"{st['ms']:9.3f}"
        lines.append(f"  {STAGE_TITLES[s]:<{tw}}  {ms:>9}  {st['cumulative_ms']:10.3f}")
    t = res["totals"]
    lines.append(f"  {'forward (Engram + MoE)':<{tw}}  {t['forward_ms']:9.3f}")
    lines.append(f"  {'forward + backward (the layers)':<{tw}}  {t['step_ms']:9.3f}")
    lines.append(f"RESULT: {'PASS' if res['ok'] else 'FAIL'}")
    return "\n".join(lines)


def _print_result(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, sort_keys=False))
    else:
        print(format_table(res))
    sys.stdout.flush()


# ------------------------------------------------------------------------------------ entry points
def _child_argv(argv: list[str]) -> list[str]:
    """argv without -n/--processes (the children run one process each)."""
    out, skip = [], False
    for i, s in enumerate(argv):
        if skip:
            skip = False
            continue
        if s in ("-n", "--processes"):
            skip = True
            continue
        if s.startswith("--processes=") or (s.startswith("-n") and s[2:].isdigit()):
            continue
        out.append(s)
    return out


def _launch_parent(a: argparse.Namespace, argv: list[str]) -> int:
    """Run this module as ``a.processes`` processes and print rank 0's result (ok only if every rank is)."""
    from jax_engram import launch

    gpu = a.platform == "gpu"
    if a.platform == "auto":
        gpu = _has_nvidia_gpu()
    per = a.gpus_per_process if gpu else a.cpu_devices
    child = _child_argv(argv) + ["--no-progress"]
    box: dict[str, Any] = {}

    def go():
        box["job"] = launch.launch(a.processes, os.path.abspath(__file__), child, "cuda" if gpu else "cpu", per,
                                   timeout=max(300.0, 4 * a.timeout), echo=False)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    bar = _Progress(0, enabled=not a.no_progress)
    if bar.bar is not None:
        bar.bar.total = None
    while th.is_alive():
        th.join(0.25)
        bar.step(f"{a.processes} processes running", 1)
    bar.close()
    job = box.get("job")
    if job is None:
        print("jax_engram: the launcher failed", file=sys.stderr)
        return 1
    if not job.ok or job.results[0] is None:
        print(job.report(), file=sys.stderr)
        return 1
    res = job.results[0]
    res["ok"] = all(r is not None and r.get("ok") for r in job.results)
    _print_result(res, a.json)
    return 0 if res["ok"] else 1


def _has_nvidia_gpu() -> bool:
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return False
    return "GPU" in out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parse(argv)
    from jax_engram import launch

    if a.processes > 1 and launch.config_from_env() is None:
        return _launch_parent(a, argv)
    cfg = launch.initialize()  # under the launcher: join the job before any backend starts
    import jax

    if cfg is None:
        if a.platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)  # only affects the CPU backend
    res = run_job(a)
    if cfg is not None:
        launch.emit_result(res)
    if jax.process_index() == 0 and cfg is None:
        _print_result(res, a.json)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
