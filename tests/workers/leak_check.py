"""Resources after init/close cycles and a failed init (one process, all local devices; CPU or CUDA).

Counts before and after: open file descriptors (/proc/self/fd), jax_engram memfd mappings and all mappings
(/proc/self/maps), Python threads and OS threads (/proc/self/task); on CUDA also the GPU's free memory
(cudaMemGetInfo). Each cycle creates a context, an Engram table (write + lookup), an EP dispatch + combine,
reads ctx.memory_info(), frees the EP buffers, and closes. Prints ``LEAKS {...}`` and ``RESULT {...}``.

Run: python tests/workers/leak_check.py --platform cpu --cpu-devices 4 --cycles 20  |  --platform cuda
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import threading
from pathlib import Path

from _harness import start, thread_names, threads_named

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="cpu", choices=["cpu", "cuda"])
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--cycles", type=int, default=20)
args = ap.parse_args()

start(args.platform, args.cpu_devices)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import ep  # noqa: E402

R = len(jax.devices())
AX = "ep"
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))


def _cuda_free_bytes():
    if args.platform != "cuda":
        return 0
    for pat in ("nvidia/cu*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
        for site in sys.path:
            for lib in glob.glob(os.path.join(site, pat)):
                try:
                    rt = ctypes.CDLL(lib)
                    free, total = ctypes.c_size_t(), ctypes.c_size_t()
                    if rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
                        return int(free.value)
                except OSError:
                    continue
    return -1


def hostgather_threads() -> int:
    """Worker threads of the Engram host gather pools (named by the native module)."""
    return threads_named("je-hostgather")


def snapshot() -> dict:
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {"fds": len(os.listdir("/proc/self/fd")), "memfd_maps": sum("memfd:jax_engram" in l for l in maps),
            "nvidia_maps": sum("nvidia" in l for l in maps), "maps": len(maps),
            "py_threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task")),
            "listening_sockets": listening_sockets(), "gpu_free_bytes": _cuda_free_bytes()}


def listening_sockets() -> int:
    """TCP/UDP sockets of this process in the LISTEN state (jax_engram itself opens none)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    n = 0
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for r in rows if r.split()[3] == "0A" and r.split()[9] in inodes)
    return n


def cycle(i: int) -> dict:
    # one_rank="kernels": at one rank (one GPU) the EP ops would otherwise take the local path, which has no buffers
    ctx = je.init(mesh, AX, timeout_s=30.0, device_bytes=(4 << 20) if i % 2 else None,
                  ep_config=je.EPConfig(one_rank="kernels"))
    try:
        if args.platform == "cuda":  # the side NCCL communicator (non-blocking init, bounded teardown) each cycle
            topo = ctx.nccl_topology()
            assert topo and all(v["nranks"] == R for v in topo.values()), topo
            nccl_info.append({k: topo[min(topo)].get(k) for k in ("window_registered", "devcomm", "lsa_size")})
        t = je.EngramTable(8, 16, jnp.bfloat16, ctx=ctx, placement="host" if i % 2 else "device")
        x = np.arange(R * 8 * 16, dtype=np.float32).reshape(R * 8, 16).astype(jnp.bfloat16)
        t.write_global(x)
        data, _ = t.lookup_global(np.array([[0, R * 8 - 1]], np.int32), mode="checked")
        assert np.array_equal(np.asarray(data, np.float32).reshape(2, 16), np.asarray(x, np.float32)[[0, R * 8 - 1]])
        hostgather_open.append(hostgather_threads())  # the CPU backend's fetch started the member's pool
        if i % 2:  # an overlapped fetch of the host table: on a GPU, its enqueue thread, fork and slot events

            def prefetch(ids):
                d, _ = t.wait(t.fetch(ids, overlap=True))
                return d

            ids = jax.device_put(jnp.tile(jnp.array([[0, 1]], jnp.int32), (R, 1)), NamedSharding(mesh, P(AX)))
            d = jax.jit(jax.shard_map(prefetch, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))(ids)
            assert np.array_equal(np.asarray(d, np.float32)[0], np.asarray(x, np.float32)[[0, 1]].ravel()), "prefetch"

        if i % 4 > 1:  # the EP part (a compile per context) in half of the cycles
            t.free()
            return {}

        def body(xs, idx):
            d = ep.dispatch(xs[0], idx[0], ctx=ctx, num_experts=2 * R, max_tokens_per_rank=4)
            cx = ep.combine(d.recv_x, d.handle).combined_x
            return cx[None]

        sh = NamedSharding(mesh, P(AX))
        xs = jax.device_put(jnp.ones((R, 4, 16), jnp.bfloat16), sh)
        idx = jax.device_put(jnp.tile(jnp.array([[0, 1]], jnp.int32), (R, 4, 1)), sh)
        out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))(xs, idx)
        assert float(np.asarray(out, np.float32).max()) == 1.0
        info = ctx.memory_info()
        open_counts.append(snapshot()["memfd_maps"])  # proves the counter sees a live context's mappings (CPU)
        assert len(info["ep_buffers"]) == 2, info["ep_buffers"]
        freed = ctx.free_ep_buffers()
        assert freed > 0 and not ctx.memory_info()["ep_buffers"]
        t.free()
        return info
    finally:
        ctx.close()


failed_init = None
open_counts: list[int] = []
hostgather_open: list[int] = []
nccl_info: list[dict] = []
cycle(0)  # warm-up: JAX's own lazily created threads, pools and caches
info0 = cycle(1)
jax.clear_caches()
before = snapshot()
threads_before = thread_names()
for i in range(args.cycles // 2):
    cycle(i)
mid = snapshot()
for i in range(args.cycles // 2, args.cycles):
    cycle(i)
end = snapshot()
try:  # a window too large for the machine: init fails and must give back what it took
    je.init(mesh, AX, timeout_s=30.0, device_bytes=1 << 50).close()
except Exception as e:  # noqa: BLE001
    failed_init = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
jax.clear_caches()
after = snapshot()
new_threads = sorted(n for t, n in thread_names().items() if t not in threads_before)
leaks = {k: after[k] - before[k] for k in before if k != "gpu_free_bytes"}
leaks["gpu_free_bytes_lost"] = before["gpu_free_bytes"] - after["gpu_free_bytes"]
# The second half of the cycles alone (a leak per cycle shows here; a library's one-time lazy state does not), and
# the failed init alone.
steady = {k: end[k] - mid[k] for k in before if k != "gpu_free_bytes"}
failed_init_leaks = {k: after[k] - end[k] for k in before if k != "gpu_free_bytes"}
print("MEMORY_INFO", json.dumps(info0), flush=True)
print("FAILED_INIT", failed_init, flush=True)
print("BEFORE", json.dumps(before), "AFTER", json.dumps(after), flush=True)
print("LEAKS", json.dumps(leaks), flush=True)
print("STEADY", json.dumps(steady), "FAILED_INIT_LEAKS", json.dumps(failed_init_leaks), flush=True)
print("NEW_THREADS", json.dumps(new_threads), flush=True)
print("RESULT " + json.dumps({"leaks": leaks, "steady": steady, "failed_init_leaks": failed_init_leaks,
                              "new_threads": new_threads,
                              "hostgather_threads_while_open": max(hostgather_open),
                              "hostgather_threads_after": hostgather_threads(),
                              "failed_init": failed_init, "cycles": args.cycles, "ranks": R,
                              "live_contexts": len(je.live_contexts()),
                              "memfd_maps_while_open": max(open_counts),
                              "nccl": nccl_info[-1] if nccl_info else None}), flush=True)
