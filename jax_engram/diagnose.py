"""`python -m jax_engram.diagnose`: diagnosis of this machine for jax_engram, after a real barrier round trip.

Prints platform, devices, processes, native backends, jaxlib / XLA FFI / NCCL versions, the context's
window sizes and peer topology, then runs a barrier and a ring exchange over every device of every
process (inside jit + shard_map) and checks the exchanged data. Exit status 0 only if all checks pass.

Runs as one process over the local devices, or under the launcher (which runs a script file):
    python -m jax_engram.launch -n 2 [--platform cuda] "$(python -c 'import jax_engram.diagnose as d; print(d.__file__)')"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(prog="python -m jax_engram.diagnose", description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                   help="auto: GPUs if jax sees any, else CPU")
    p.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process on the CPU platform")
    p.add_argument("--timeout", type=float, default=60.0, help="context timeout_s")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON too")
    return p.parse_args()


def main() -> int:
    args = _parse()
    try:  # under python -m jax_engram.launch: join the job before any backend starts
        from jax_engram import launch

        launch.initialize()
    except ImportError:
        pass
    import jax

    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    if "JAX_ENGRAM_NUM_PROCESSES" not in os.environ:  # the launcher already set the per-process count
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # only affects the CPU backend
    import jaxlib

    import jax_engram as je
    from jax_engram import _ffi

    devices = jax.devices()
    if args.platform == "gpu" and devices[0].platform != "gpu":
        print("jax_engram: --platform gpu but jax sees no GPU", file=sys.stderr)
        return 2
    platform = devices[0].platform
    rank0 = jax.process_index() == 0
    lines = []

    def out(k, v):
        lines.append((k, v))

    out("jax / jaxlib", f"{jax.__version__} / {jaxlib.__version__} (XLA FFI API {_ffi.running_ffi_api()})")
    out("platform", platform)
    out("processes", f"{jax.process_count()} (this is process {jax.process_index()})")
    out("devices", f"{len(devices)} total, {jax.local_device_count()} local: "
        + ", ".join(f"{d.id}:{d.device_kind}" for d in jax.local_devices()))
    mod = _ffi.native(platform)
    out("native backend", f"{mod.__name__} built against jaxlib {mod.build_info['jaxlib']} "
        f"(FFI API {tuple(mod.build_info['ffi_api'])})")
    if platform == "gpu":
        out("NCCL", getattr(mod, "nccl_versions", lambda: "n/a")())
    else:
        out("CUDA module", "available" if _ffi.cuda_available() else "not built/loadable here")

    mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    t0 = time.perf_counter()
    ctx = je.init(mesh, "x", device_bytes=8 << 20, host_bytes=8 << 20, timeout_s=args.timeout)
    t_init = time.perf_counter() - t0
    info = ctx.info()
    out("context", f"{ctx!r}, init {t_init * 1e3:.1f} ms")
    w = info["window"]
    out("window per rank", f"workspace {w['workspace_bytes'] >> 20} MiB | device segment "
        f"{w['device_segment_bytes'] >> 20} MiB | host segment {w['host_segment_bytes'] >> 20} MiB")
    if ctx.platform != "cpu" and ctx.ranks_per_gpu == 1:
        for ordinal, topo in sorted(ctx.nccl_topology().items()):
            out(f"topology (device {ordinal})", json.dumps(topo, sort_keys=True))

    _time_barrier(ctx, mesh, out)
    ok = _check_ring_exchange(ctx, mesh, out)
    try:
        ctx.check()
        out("device error records", "none")
    except je.JaxEngramError as e:
        ok = False
        out("device error records", str(e))
    ctx.close()

    if rank0 or jax.process_count() == 1:
        width = max(len(k) for k, _ in lines)
        print("jax_engram diagnosis")
        for k, v in lines:
            print(f"  {k:<{width}}  {v}")
        print("RESULT:", "PASS" if ok else "FAIL")
        if args.json:
            print(json.dumps(dict(lines)))
    try:
        from jax_engram import launch

        launch.emit_result({"ok": ok})
    except Exception:
        pass
    return 0 if ok else 1


def _time_barrier(ctx, mesh, out) -> None:
    """Times a jitted barrier over every rank (its round trip, dispatch included)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_engram as je

    bar = jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx)[None], mesh=mesh, in_specs=(), out_specs=P("x")))
    bar().block_until_ready()
    t0 = time.perf_counter()
    iters = 20
    for _ in range(iters):
        bar().block_until_ready()
    t_bar = (time.perf_counter() - t0) / iters
    out("barrier round trip", f"{t_bar * 1e6:.1f} us per jitted call over {ctx.num_ranks} ranks (incl. dispatch)")


def _check_ring_exchange(ctx, mesh, out) -> bool:
    """A ring exchange through every rank's window, in each segment: rank r must hold rank r-1's block."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_engram as je

    n = ctx.num_ranks
    ok = True
    local = np.arange(4 * jax.local_device_count(), dtype=np.float32) + 1000 * jax.process_index()
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local, (4 * n,))
    for placement in ("device", "host"):
        f = jax.jit(jax.shard_map(lambda a, p=placement: je.ring_exchange(a, ctx=ctx, placement=p), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        y = f(x)
        full_rows = {}
        for shard in y.addressable_shards:
            r = (shard.index[0].start or 0) // 4  # a 1-device mesh's shard index is slice(None)
            full_rows[r] = np.asarray(shard.data)
        xs = {(shard.index[0].start or 0) // 4: np.asarray(shard.data) for shard in x.addressable_shards}
        good = True
        for r, got in full_rows.items():
            left = (r - 1) % n
            want = xs.get(left)
            if want is None:  # left neighbour lives in another process: its values are known by construction
                proc = mesh.devices[left].process_index
                loc = [d for d in jax.devices() if d.process_index == proc]
                k = [d.id for d in loc].index(mesh.devices[left].id)
                want = np.arange(4 * len(loc), dtype=np.float32)[4 * k:4 * k + 4] + 1000 * proc
            good &= bool(np.array_equal(got, want))
        ok &= good
        out(f"ring exchange ({placement} segment)", "PASS" if good else "FAIL")
    return ok


if __name__ == "__main__":
    sys.exit(main())
