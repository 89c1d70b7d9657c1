"""Model-step benchmark: what Engram costs a dense training / inference step with host tables of production size.

The model: a dense stack of ``--layers`` layers (default 16), hidden ``--hidden`` (4096), bf16; each layer is
``x += (q * sigmoid(k) + v) W_out`` with ``[q, k, v] = rms(x) W_qkv`` and ``x += gelu(rms(x) W_up) W_down``
(``W_up`` 4x wide): four ``jnp.dot`` (cuBLAS GEMMs on a GPU) and a few elementwise kernels. T tokens per rank
(``--T``, default 4096 and 512). At each Engram layer (``--engram-layers``, default 1 and 14) the rows of
``--E`` (24) ids per token are fetched from that layer's own table and added before the layer:
``x + sigmoid(<rms(x), rms(m W_key)> / sqrt(H)) * (m W_value)`` (jax_engram.layers.engram_gate_add's formula,
its two projections as bf16 GEMMs), where m is the token's rows, dequantised for FP8. Rows (``--row-dtype``):

  fp8   256 float8_e4m3fn values + 2 float32 scale packs (one per 128 values): 264 B per row (DeepSeek's shape)
  bf16  128 bfloat16 values: 256 B per row

The host tables hold ``--table-gib`` GiB of rows in all (the 256-B data rows; FP8's scale table, replicated in HBM,
comes on top), split evenly over the Engram layers (default 48 GiB: two tables of 24 GiB). They are filled once,
from random finite values made on the device by one elementwise kernel, and written with ``EngramTable.write``.

Variants (each timed forward, and for training as forward + backward: ``jax.value_and_grad`` over every layer's
weights and the Engram projections; the rows are constants):

  none                 no Engram layer at all
  resident             the Engram math on rows already in HBM (the projections only): what the goal compares with
  lookup[gpu|cpu]      ``table.lookup`` at the layer, ordered after the layer's input
  prefetch[gpu|cpu]    ``table.fetch(ids, overlap=True)`` of every Engram layer at step start, in layer order (each
                       ``after=`` the previous one's status), the wait at the layer,
                       ordered after the layer's input (``wait(after=h)``)
  take_hbm             MaxText-style: the table as a plain HBM array and ``jnp.take`` (the same rows when every
                       table fits under ``--take-max-gib``, else smaller tables of that total: the row says so)

[gpu|cpu] is the host path, ``EngramConfig(host_gather=...)``: "gpu" = the GPU's own gather of host memory, "cpu" =
CPU threads gather into pinned staging and the GPU copies it. Where ``EngramConfig`` has no ``host_gather`` field,
the "gpu" variants run the default config and the "cpu" variants are skipped with a note.

The timed steps cycle through ``--id-sets`` sets of ids (with their resident rows), as a model's steps see new
tokens: by default enough sets that one cycle's rows are twice the host's last-level cache (at least 256 MiB), so
no step finds its host rows in a CPU cache that an earlier step filled.

Also measured: each path's fetch alone (the lookups of every Engram layer, nothing else) in GB/s of rows (scale
packs included), and on a GPU the same-run pinned host -> device copy (the link). Reported: a table of variant x
(T, forward/train) with ms per step and overhead % against ``resident`` and against ``none``; the JSON
(``--out``) and, through ``python -m jax_engram.bench model``, PNG plots (overhead and fetch GB/s against table
size; ``--table-gib`` takes a comma list for a size sweep, each size refilled).

Memory: host RAM holds every host table (checked against MemAvailable before filling); HBM holds the model, and
for take_hbm the HBM copies of the tables (``--take-max-gib``).

Run:
  python benchmarks/bench_model.py --out model.json                     # one H200: fp8, T 4096 and 512, 48 GiB
  python benchmarks/bench_model.py --row-dtype bf16 --T 4096 --quick --out model_bf16.json
  JAX_PLATFORMS=cpu python benchmarks/bench_model.py --smoke --out /tmp/m.json   # CPU plumbing check, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from jax_engram.launch import initialize, shutdown  # noqa: E402

VARIANTS = ("none", "resident", "lookup[gpu]", "lookup[cpu]", "prefetch[gpu]", "prefetch[cpu]", "take_hbm")
ROW_FORMATS = {  # values per row, dtype name, scale packs, bytes per row (data + scale packs)
    "fp8": dict(values=256, dtype="float8_e4m3fn", sf_packs=2, row_bytes=256 + 8),
    "bf16": dict(values=128, dtype="bfloat16", sf_packs=0, row_bytes=256),
}

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--out", default=None, help="write the JSON results here")
ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (4 CPU devices when not launched): checks "
                "the plumbing in seconds, measures nothing meaningful")
ap.add_argument("--quick", action="store_true", help="fewer timed steps (--iters 5, --warmup 1)")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--T", default="4096,512", help="tokens per rank, a comma list")
ap.add_argument("--engram-layers", default="1,14", help="layers with an Engram lookup before them")
ap.add_argument("--E", type=int, default=24, help="ids per token per Engram layer")
ap.add_argument("--row-dtype", default="fp8", choices=sorted(ROW_FORMATS))
ap.add_argument("--table-gib", default="48", help="GiB of host rows in all (split over the Engram layers); a comma "
                "list sweeps sizes")
ap.add_argument("--table-rows", type=int, default=0, help="rows per table instead of --table-gib (smoke runs)")
ap.add_argument("--take-max-gib", type=float, default=56.0, help="take_hbm: HBM for its tables in all; larger "
                "host tables are scaled down to this for take_hbm")
ap.add_argument("--variants", default=",".join(VARIANTS))
ap.add_argument("--modes", default="fwd,train")
ap.add_argument("--iters", type=int, default=10, help="timed steps per variant and round, the variants interleaved "
                "call by call (A B C, B C A, ...; each sample of every variant on the same id set); back to back: "
                "iters // 2 (at least 3) samples of iters steps, interleaved the same way")
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--rounds", type=int, default=1, help="time every variant of a (T, mode) this many times: ms is the "
                "median of the rounds, and each overhead the median of the per-round ratios")
ap.add_argument("--id-sets", type=int, default=0, help="different id sets (and their resident rows) the timed steps "
                "cycle through, as a model's steps see new tokens (0: enough that one cycle's rows are twice the "
                "host's last-level cache, at least 256 MiB of rows, at most 64 sets)")
ap.add_argument("--host-threads", type=int, default=0, help="EngramConfig.host_threads of the [cpu] variants "
                "(0: the library's default)")
ap.add_argument("--profile", default=None, help="also record 6 steps of every variant with jax.profiler into "
                "this folder, 3 timed to their end and 3 back to back (one trace per variant, mode and T; view in "
                "Perfetto or TensorBoard, or summarize with tools/profile_gaps.py)")
args = ap.parse_args()
if args.quick:
    args.iters, args.warmup = min(args.iters, 5), 1
if args.smoke:
    args.layers, args.hidden, args.T, args.engram_layers, args.E = 3, 64, "8", "1,2", 4
    args.table_rows = args.table_rows or 2048
    args.iters, args.warmup = 2, 1
    args.id_sets = args.id_sets or 2

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
cfg_launch = initialize()
import jax  # noqa: E402

if cfg_launch is None and args.smoke and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _ceilings as CEIL  # noqa: E402
import _common as C  # noqa: E402
import _hostside as HS  # noqa: E402
import jax_engram as je  # noqa: E402
from jax_engram.bench import report  # noqa: E402

AX = "ep"
LEAD = jax.process_index() == 0
GiB = 1 << 30


def say(*a):
    if LEAD:
        print(*a, flush=True)


mesh = C.make_ep_mesh(axis_name=AX)
R = mesh.shape[AX]
ctx = je.init(mesh, AX, timeout_s=300.0)
FMT = ROW_FORMATS[args.row_dtype]
RDT = np.dtype(jnp.float8_e4m3fn) if args.row_dtype == "fp8" else np.dtype(jnp.bfloat16)
L, H, E = args.layers, args.hidden, args.E
ELAYERS = [int(x) for x in args.engram_layers.split(",") if x]
if any(not 0 <= e < L for e in ELAYERS) or len(set(ELAYERS)) != len(ELAYERS):
    raise SystemExit(f"--engram-layers {ELAYERS}: must be distinct layers in [0, {L})")
M = E * FMT["values"]  # memory width per token (dequantised values)
NOTES: list[str] = []


# ------------------------------------------------------------------------------------------------ host paths
def path_config(path: str):
    """EngramConfig for a host path, or None where this build cannot select it (the reason goes to NOTES)."""
    if "host_gather" in {f.name for f in dataclasses.fields(je.EngramConfig)}:
        return je.EngramConfig(host_gather=path, host_threads=args.host_threads)
    if path == "gpu":
        note = "EngramConfig has no host_gather field: the [gpu] variants run the default config (the GPU's gather)"
        if note not in NOTES:
            NOTES.append(note)
        return je.EngramConfig()
    note = "EngramConfig has no host_gather field: the [cpu] variants (CPU gather into pinned staging) are skipped"
    if note not in NOTES:
        NOTES.append(note)
    return None


def _wait_after(table, pending, h):
    """Wait for a prefetched lookup, ordered after ``h`` (the Engram layer's input; ``after=`` carries no
    derivative, the rows are constants)."""
    return table.wait(pending, after=h)


# ------------------------------------------------------------------------------------------------- the model
def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def dense_layer(p, x):
    qkv = jnp.dot(_rms(x), p["qkv"])
    q, k, v = jnp.split(qkv, 3, axis=-1)
    x = x + jnp.dot(q * jax.nn.sigmoid(k) + v, p["out"])
    return x + jnp.dot(jax.nn.gelu(jnp.dot(_rms(x), p["up"])), p["down"])


def dequant(data, sf):
    """[T, E*values] rows (+ [T, E*packs] float32 scales for FP8) -> [T, M] bf16."""
    T = data.shape[0]
    if sf is None:
        return data.astype(jnp.bfloat16)
    packs = FMT["sf_packs"]
    v = data.reshape(T, E, packs, FMT["values"] // packs).astype(jnp.float32) * sf.reshape(T, E, packs, 1)
    return v.reshape(T, M).astype(jnp.bfloat16)


def engram_math(p, x, data, sf):
    """layers.engram_gate_add's gated add, the projections as bf16 GEMMs (f32 accumulation)."""
    m = dequant(data, sf)
    k = jnp.dot(m, p["w_key"], preferred_element_type=jnp.float32)
    v = jnp.dot(m, p["w_value"], preferred_element_type=jnp.float32)
    h = x.astype(jnp.float32)
    rms = lambda a: a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    gate = jax.nn.sigmoid(jnp.sum(rms(h) * rms(k), axis=-1, keepdims=True) / math.sqrt(H))
    return (h + gate * v).astype(x.dtype)


def init_params():
    def gen(key):
        ks = iter(jax.random.split(key, 4 * L + 2 * len(ELAYERS)))
        w = lambda shape: (jax.random.normal(next(ks), shape, jnp.float32) / math.sqrt(shape[0])).astype(jnp.bfloat16)  # noqa
        layers = [dict(qkv=w((H, 3 * H)), out=w((H, H)), up=w((H, 4 * H)), down=w((4 * H, H))) for _ in range(L)]
        eng = {str(l): dict(w_key=w((M, H)), w_value=w((M, H))) for l in ELAYERS}
        return dict(layers=layers, engram=eng)
    return jax.jit(gen, out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))


# ----------------------------------------------------------------------------------------------- the tables
def _sf_map(raw):
    """FP8 scale packs from hashed float32 words: positive, finite, near 2^-6."""
    return jnp.abs(raw) * 2.0 ** -70 + 2.0 ** -6


def _fill_fn(rows_global: int, seed: int):
    """A jitted maker of [rows_global, values] random finite rows of the row dtype (_common.hashed_rows_fn: one
    elementwise kernel, no temporary of the table's size) and, for FP8, its [rows_global, packs] scale packs: the
    values C.fill_hashed(table, seed, sf_seed=seed + 1, sf_map=_sf_map) writes into a table of rows_global rows."""
    sh = NamedSharding(mesh, P(AX, None))
    x_fn = C.hashed_rows_fn(rows_global, FMT["values"], RDT, seed, sh)
    if not FMT["sf_packs"]:
        return lambda: (x_fn(np.uint32(0)), None)
    raw = C.hashed_rows_fn(rows_global, FMT["sf_packs"], np.float32, seed + 1, None)
    s_fn = jax.jit(lambda: _sf_map(raw(np.uint32(0))), out_shardings=NamedSharding(mesh, P()))
    return lambda: (x_fn(np.uint32(0)), s_fn())


def meminfo_gib(key="MemAvailable"):
    try:
        for line in open("/proc/meminfo"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def make_tables(table_gib: float):
    """The host tables (one per Engram layer) and, for take_hbm, HBM arrays. Returns (tables, hbm, info)."""
    if args.table_rows:
        per_rank = max(1, args.table_rows // R)
    else:
        per_rank = int(table_gib * GiB / len(ELAYERS) / 256 / R)  # 256-B data rows (FP8: 256 values)
    total_rows = per_rank * R
    host_gib = len(ELAYERS) * per_rank * FMT["values"] * RDT.itemsize / GiB  # per rank (process)
    avail = meminfo_gib()
    say(f"# tables: {len(ELAYERS)} x {total_rows} rows x {FMT['values']} {RDT.name}"
        + (f" + {FMT['sf_packs']} float32 scale packs" if FMT["sf_packs"] else "")
        + f" = {host_gib:.2f} GiB of host rows per rank; host RAM available {avail if avail is None else round(avail, 1)} GiB")
    if avail is not None and host_gib * max(1, len(jax.local_devices())) > avail - 4:
        raise SystemExit(f"bench_model: the host tables need {host_gib:.1f} GiB per rank of host RAM and "
                         f"{avail:.1f} GiB is available (keeping 4 GiB free): lower --table-gib")
    take_total = len(ELAYERS) * total_rows * FMT["row_bytes"] / GiB
    take_rows = total_rows if take_total <= args.take_max_gib else max(
        1, int(args.take_max_gib * GiB / len(ELAYERS) / FMT["row_bytes"]))
    want_take = "take_hbm" in args.variants.split(",")
    tables, hbm = {}, {}
    t0 = time.perf_counter()
    for i, l in enumerate(ELAYERS):
        t = je.EngramTable(per_rank, FMT["values"], RDT, ctx=ctx, placement="host", num_sf_packs=FMT["sf_packs"])
        # a slice at a time (the devices never hold a whole shard: host tables larger than HBM fill)
        jax.block_until_ready(C.fill_hashed(t, 1000 + i, sf_seed=1001 + i, sf_map=_sf_map))
        tables[l] = t
        if want_take and take_rows == total_rows:  # the same rows in HBM
            x, s = _fill_fn(total_rows, 1000 + i)()
            hbm[str(l)] = (jax.device_put(x, NamedSharding(mesh, P())), s)  # one device: no copy
            del x, s
    fill_s = time.perf_counter() - t0
    if want_take and take_rows != total_rows:
        for i, l in enumerate(ELAYERS):
            hbm[str(l)] = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())),
                                  _fill_fn(take_rows, 2000 + i)())
        NOTES.append(f"take_hbm: the host tables ({take_total:.1f} GiB) exceed --take-max-gib {args.take_max_gib}: "
                     f"take_hbm reads HBM tables of {take_rows} rows each ({len(ELAYERS) * take_rows * FMT['row_bytes'] / GiB:.1f} GiB in all)")
    say(f"# filled in {fill_s:.1f} s")
    info = dict(rows_per_table=total_rows, rows_per_rank=per_rank, host_gib_per_rank=host_gib,
                table_gib=len(ELAYERS) * total_rows * 256 / GiB, take_rows=take_rows if want_take else None,
                take_scaled=want_take and take_rows != total_rows, fill_s=fill_s, host_ram_available_gib=avail)
    return tables, hbm, info


# ------------------------------------------------------------------------------------------------ the steps
def build(variant: str, mode: str, tables, hbm, take_rows):
    """A jitted step: fwd(params, x, ids, rows, hbm) -> x; train(...) -> (loss, grads). None if not runnable."""
    kind, path = (variant.split("[") + [""])[:2]
    path = path.rstrip("]")
    cfg = None
    if path:
        cfg = path_config(path)
        if cfg is None:
            return None

    def forward(params, x, ids, rows, hbm_tabs):
        pend = {}
        if kind == "prefetch":
            prev = None
            for l in ELAYERS:  # in layer order (the fetches share one side stream): each after the one before
                pend[l] = tables[l].fetch(ids[str(l)], overlap=True, config=cfg,
                                          after=None if prev is None else prev.status)
                prev = pend[l]
            x = je.start_before(x, *pend.values())  # the fetches start before layer 0 (XLA may sink them otherwise)
        for i in range(L):
            if i in ELAYERS and kind != "none":
                k = str(i)
                if kind == "resident":
                    data, sf = rows[k]
                elif kind == "lookup":
                    data, sf = tables[i].lookup(ids[k], after=jax.lax.stop_gradient(x), config=cfg)
                elif kind == "prefetch":
                    data, sf = _wait_after(tables[i], pend[i], x)
                else:  # take_hbm
                    tab, sft = hbm_tabs[k]
                    flat = (ids[k] % take_rows).reshape(-1)
                    data = jnp.take(tab, flat, axis=0).reshape(x.shape[0], -1)
                    sf = None if sft is None else jnp.take(sft, flat, axis=0).reshape(x.shape[0], -1)
                x = engram_math(params["engram"][k], x, data, sf)
            x = dense_layer(params["layers"][i], x)
        return x

    def fwd_body(params, x, ids, rows, hbm_tabs):
        return forward(params, x, ids, rows, hbm_tabs)

    def train_body(params, x, ids, rows, hbm_tabs):
        def loss(p):
            y = forward(p, x, ids, rows, hbm_tabs).astype(jnp.float32)
            return jnp.mean(y * y)
        val, g = jax.value_and_grad(loss)(params)
        return jax.lax.pmean(val, AX), jax.lax.pmean(g, AX)

    tok = P(AX, None)
    in_specs = (P(), tok, P(AX, None), P(AX, None), P())
    out_specs = tok if mode == "fwd" else (P(), P())
    body = fwd_body if mode == "fwd" else train_body
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def fetch_alone_fn(kind: str, path: str, tables, take_rows):
    """The lookups of every Engram layer and nothing else (a path's fetch rate); None if not runnable."""
    cfg = path_config(path) if kind == "lookup" else None
    if kind == "lookup" and cfg is None:
        return None

    def body(ids, hbm_tabs):
        out = []
        for l in ELAYERS:
            k = str(l)
            if kind == "lookup":
                out.append(tables[l].lookup(ids[k], config=cfg))
            else:
                tab, sft = hbm_tabs[k]
                flat = (ids[k] % take_rows).reshape(-1)
                out.append((jnp.take(tab, flat, axis=0), None if sft is None else jnp.take(sft, flat, axis=0)))
        return out
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX, None), P()), out_specs=P(AX)))


def id_sets_for(step_bytes: int) -> int:
    """How many id sets the steps cycle through (--id-sets): one cycle's rows are at least twice the host's
    last-level cache and at least 256 MiB, so that no step finds its host rows in a cache an earlier step filled."""
    if args.id_sets:
        return args.id_sets
    return C.rotations_for_cache(step_bytes, cache_bytes=max(HS.llc_bytes() or 0, 128 << 20), factor=2.0,
                                 max_sets=64)


def _ms(t):
    return t["median_us"] / 1e3


def run_size(table_gib: float, params, link_gbps):
    tables, hbm, tinfo = make_tables(table_gib)
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    modes = [m for m in args.modes.split(",") if m]
    take_rows = tinfo["take_rows"] or 1
    rows_out, fetch_rows = [], []
    for T in [int(t) for t in args.T.split(",") if t]:
        x = jax.jit(lambda k: jax.random.normal(k, (R * T, H), jnp.float32).astype(jnp.bfloat16),
                    out_shardings=NamedSharding(mesh, P(AX, None)))(jax.random.key(T))
        nbytes = len(ELAYERS) * T * E * FMT["row_bytes"]
        nsets = id_sets_for(nbytes)
        gen = jax.jit(lambda k: jax.random.randint(k, (R * T, E), 0, R * tinfo["rows_per_rank"], jnp.int32),
                      out_shardings=NamedSharding(mesh, P(AX, None)))
        id_sets = []  # (ids, resident rows) per set: the resident variant reads the same rows from HBM
        for s_ in range(nsets):
            ids_s = {str(l): gen(jax.random.key(100 + 1000 * s_ + l)) for l in ELAYERS}
            id_sets.append((ids_s, {str(l): tuple(tables[l].lookup_global(ids_s[str(l)])) for l in ELAYERS}))
        say(f"T={T}: the steps cycle through {nsets} id sets ({nsets * nbytes / 2**20:.0f} MiB of rows per cycle)")
        base = {}
        for mode in modes:
            mode_rows, fns = [], {}
            for v in variants:
                row = dict(variant=v, T=T, mode=mode, table_gib=tinfo["table_gib"], row_dtype=args.row_dtype,
                           id_sets=nsets)
                fn = build(v, mode, tables, hbm, take_rows)
                if fn is None:
                    row["skipped"] = "host_gather='cpu' is not available in this build (EngramConfig.host_gather)"
                    say(f"T={T} {mode} {v}: skipped ({row['skipped']})")
                    rows_out.append(row)
                    continue
                if v == "take_hbm" and tinfo["take_scaled"]:
                    row["note"] = f"HBM tables of {take_rows} rows (scaled down)"
                mode_rows.append(row)
                fns[v] = fn
            samples = {v: ([], []) for v in fns}  # per round: per-call ms, back-to-back ms
            arg_sets = [(params, x, i_, r_, hbm) for i_, r_ in id_sets]
            for rnd in range(max(args.rounds, 1)):
                failed = {r["variant"] for r in mode_rows if "error" in r}
                live = {v: fn for v, fn in fns.items() if v not in failed}
                # the variants interleaved call by call, on the same id set per sample (C.time_interleaved)
                per = C.time_interleaved(live, arg_sets=arg_sets, warmup=args.warmup if rnd == 0 else 1,
                                         iters=args.iters)
                # the same steps back to back (a training loop): host-side costs overlap the device's work
                b2b = C.time_interleaved(live, arg_sets=arg_sets, warmup=1, iters=max(3, args.iters // 2),
                                         steps=args.iters)
                for row in mode_rows:
                    v = row["variant"]
                    if v not in live:
                        continue
                    t, tb = per[v], b2b[v]
                    if "error" in t or "error" in tb:
                        row["error"] = t.get("error") or tb["error"]
                        continue
                    samples[v][0].append(_ms(t))
                    samples[v][1].append(_ms(tb))
                    if rnd == 0:
                        row.update(p10_ms=t["p10_us"] / 1e3, p90_ms=t["p90_us"] / 1e3)
            if args.profile:
                for v, fn in fns.items():
                    tag = f"{v.replace('[', '_').rstrip(']')}_{mode}_T{T}"
                    with jax.profiler.trace(str(Path(args.profile) / tag), create_perfetto_trace=True):
                        for i_ in range(3):
                            jax.block_until_ready(fn(*arg_sets[i_ % nsets]))
                        jax.block_until_ready([fn(*arg_sets[(3 + i_) % nsets]) for i_ in range(3)])
            for row in mode_rows:
                v = row["variant"]
                if "error" not in row:
                    per, b2b = samples[v]
                    row.update(ms=float(np.median(per)), b2b_ms=float(np.median(b2b)))
                    if len(per) > 1:
                        row.update(rounds_ms=per, rounds_b2b_ms=b2b)
                    base[(mode, v)] = row["ms"]
                    base[(mode, v, "b2b")] = row["b2b_ms"]
                say(f"T={T} {mode} {v}: " + (f"{row['ms']:.3f} ms per call, {row['b2b_ms']:.3f} ms back to back"
                                             + (f" (median of {len(samples[v][0])} rounds)" if args.rounds > 1 else "")
                                             if "ms" in row else row["error"]))
                rows_out.append(row)
        rounds_of = {(r["mode"], r["variant"]): r for r in rows_out if r["T"] == T and r.get("rounds_ms")}
        for row in rows_out:
            if row["T"] != T or "ms" not in row:
                continue
            for ref in ("resident", "none"):
                b = base.get((row["mode"], ref))
                row[f"vs_{ref}_pct"] = 100.0 * (row["ms"] / b - 1.0) if b else None
                b = base.get((row["mode"], ref, "b2b"))
                row[f"b2b_vs_{ref}_pct"] = 100.0 * (row["b2b_ms"] / b - 1.0) if b and row.get("b2b_ms") else None
                # Several rounds: the overhead is the median of the per-round ratios (each round interleaves the
                # variants call by call, so a drift of the machine within and between rounds cancels in the ratio).
                ref_row = rounds_of.get((row["mode"], ref))
                if ref_row is not None and row.get("rounds_ms"):
                    for key, pct in (("rounds_ms", f"vs_{ref}_pct"), ("rounds_b2b_ms", f"b2b_vs_{ref}_pct")):
                        per = [100.0 * (a / r - 1.0) for a, r in zip(row[key], ref_row[key])]
                        row[pct] = float(np.median(per))
                        row[f"rounds_{pct}"] = per
        # each path's fetch alone, at this T
        for kind, path in (("lookup", "gpu"), ("lookup", "cpu"), ("take_hbm", "")):
            name = f"{kind}[{path}]" if path else kind
            if name not in variants:
                continue
            r = dict(path=name, T=T, table_gib=tinfo["table_gib"], bytes=nbytes, row_dtype=args.row_dtype)
            fn = fetch_alone_fn(kind, path, tables, take_rows)
            if fn is None:
                r["skipped"] = "host_gather='cpu' not available"
            else:
                try:
                    t = C.time_fn(fn, arg_sets=[(i_, hbm) for i_, _ in id_sets], warmup=args.warmup,
                                  iters=args.iters)
                    r.update(ms=_ms(t), gbps=C.gbps(nbytes, t["median_us"]))
                    r["pct_link"] = 100 * r["gbps"] / link_gbps if link_gbps and kind == "lookup" else None
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            say(f"T={T} fetch alone {name}: " + (f"{r['ms']:.3f} ms, {r['gbps']:.1f} GB/s" if "ms" in r
                                                 else str(r.get("skipped") or r.get("error"))))
            fetch_rows.append(r)
    for t in tables.values():
        t.free()
    del hbm
    return rows_out, fetch_rows, tinfo


def main():
    info = C.env_info()
    sizes = [float(s) for s in args.table_gib.split(",") if s]
    say(f"bench_model: {R} ranks, {info['device_kind']} ({info['backend']}), jax {info['jax']}; {L} layers, hidden "
        f"{H}, Engram at {ELAYERS}, E={E}, rows {args.row_dtype} ({FMT['row_bytes']} B), T {args.T}, "
        f"modes {args.modes}, iters {args.iters}")
    link = None
    if info["backend"] != "cpu":
        try:
            h = CEIL.host_to_device_ceiling(256 << 20, device=jax.local_devices()[0], iters=5)
            link = (h.get("h2d") or {}).get("gbps")
        except Exception as e:  # noqa: BLE001
            NOTES.append(f"link ceiling failed: {type(e).__name__}: {str(e)[:200]}")
        say(f"ceiling pinned host -> device: {link if link is None else round(link, 1)} GB/s")
    params = init_params()
    steps, fetch, tinfos = [], [], []
    for s in sizes:
        a, b, ti = run_size(s, params, link)
        steps += a
        fetch += b
        tinfos.append(ti)
    shown = C.shown_args(args)  # no machine paths in the JSON
    res = dict(env=info, args=shown, ranks=R, config=dict(layers=L, hidden=H, engram_layers=ELAYERS, E=E,
               row_dtype=args.row_dtype, row_bytes=FMT["row_bytes"], memory_width=M), tables=tinfos,
               ceilings=dict(h2d_gbps=link), steps=steps, fetch=fetch, notes=NOTES)
    if LEAD:
        print()
        print(report.model_table(res))
    if args.out and LEAD:
        C.write_json(args.out, res)
        say(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    finally:
        C.close_quietly(ctx, shutdown)
