"""EP dispatch / combine checks on any platform, bit-exact against jax_engram.reference.

Standalone (one process over all local devices):   python tests/workers/ep_check.py [--platform cpu --cpu-devices 4]
Under the launcher:                                python -m jax_engram.launch -n 2 [--platform cuda] tests/workers/ep_check.py
Options: --suite full|quick|grad|errors|cache|lanes|example (comma-separated), --cases SUBSTR (filter case names),
--cuda-graphs (the context's cuda_graphs=True; with XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 XLA captures every EP
op it may into a CUDA graph, and the RESULT line reports how many were captured).
Prints `CHECK <name> PASS|FAIL <detail>` lines and one `RESULT <json>` line ({"checks": {name: bool}, ...}).

Every case runs, in one jitted shard_map: dispatch -> cached dispatch (new x / weights, handle of the first)
-> combine (random y over ALL rows, so rows the combine must not read hold garbage). Compared: every defined
row (valid rows; zero-padding rows when requested), counts and psums, metadata, dst_row (against the
reference row of each source token), the cached outputs, combined_x (bit-exact) and combined_topk_weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto")
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--suite", default="full")
ap.add_argument("--cases", default="")
ap.add_argument("--timeout", type=float, default=120.0)
ap.add_argument("--cuda-graphs", action="store_true", help="create the context with cuda_graphs=True")
ap.add_argument("--ep-config", default="", help="jax_engram.EPConfig fields of every context, e.g. "
                "dispatch_copy_engine=always,copy_engine_pieces=3")
ap.add_argument("--wide-only", action="store_true", help="only the cases marked wide (for 4+ ranks)")
ap.add_argument("--nodes", type=int, default=0, help="hierarchical EP group: a (nodes, R/nodes) mesh with axes "
                "(\"node\", \"gpu\") and je.init(mesh, (\"node\", \"gpu\")) (suites cases, cache, gradne)")
ap.add_argument("--ref-dir", default="", help="share reference results between processes / runs (process 0 "
                "computes, the others wait for its files); default: every process computes its own")
args = ap.parse_args()

REPO = Path(__file__).resolve().parents[2]
try:
    from jax_engram import launch
except ModuleNotFoundError:
    sys.path.insert(0, str(REPO))
    from jax_engram import launch

launch.initialize()
import jax  # noqa: E402

if "JAX_ENGRAM_NUM_PROCESSES" not in os.environ:
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    elif args.platform in ("gpu", "cuda"):
        jax.config.update("jax_platforms", "cuda,cpu")  # cpu: host callbacks (checked mode)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import ep  # noqa: E402


def _parse_ep_config(text: str) -> "je.EPConfig":
    kw = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        kw[k] = v if k == "dispatch_copy_engine" else int(v)
    return je.EPConfig(**kw)


EPC = _parse_ep_config(args.ep_config)
_REF_SRC = (REPO / "jax_engram" / "reference.py").read_bytes()  # read with the import: keys the reference cache
from jax_engram import reference as ref  # noqa: E402

results: dict[str, bool] = {}
T0 = time.time()


def check(name, fn):
    t = time.time()
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001
        ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    results[name] = bool(ok)
    print(f"CHECK {name} {'PASS' if ok else 'FAIL'} ({time.time() - t:.1f}s) {detail if not ok else ''}".rstrip(),
          flush=True)


devices = jax.devices()
R = len(devices)
if args.nodes:
    AX = ("node", "gpu")
    mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(args.nodes, -1),
                             AX, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
else:
    AX = "ep"
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
SPEC = P(AX)


def shard(full):
    """Global [R, ...] numpy array -> jax array sharded on axis 0 along 'ep' (built per process)."""
    full = np.asarray(full)
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, SPEC), lambda idx: full[idx])


def local(arr):
    """{rank: numpy block} for the ranks this process owns (arr is [R, ...] sharded on axis 0)."""
    return {s.index[0].start or 0: np.asarray(s.data)[0] for s in arr.addressable_shards}


def bits(a):
    """Floating arrays as unsigned ints of their width (bit-exact comparison, NaN-safe)."""
    a = np.asarray(a)
    if a.dtype.kind in "fV" or a.dtype.name in ("bfloat16", "float8_e4m3fn"):
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    return a


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


# ------------------------------------------------------------------------------------------------ data
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    E_loc: int = 8
    K: int = 8
    H: int = 128
    M: int = 24
    expand: bool = False
    A: int = 1
    zp: bool = False
    dtype: str = "bfloat16"   # x dtype (float8_e4m3fn -> with scales)
    P: int = 0                # scales per token
    nbias: int = 0
    weights: bool = True
    ragged: bool = True       # rank r has max(1, M - r) real tokens
    masked: float = 0.1
    unbalanced: bool = False
    det: bool = False
    seed: int = 0
    wide: bool = False        # also run with 4+ ranks
    sms: int = 0              # num_sms of the CUDA kernels (0 = automatic; ignored on CPU)


def make_routing(rng, c: Case, E):
    N = c.M
    scores = rng.random((R, N, E))
    if c.unbalanced:  # most tokens prefer rank 0's experts
        pref = rng.random((R, N)) < 0.85
        scores[..., : c.E_loc] += pref[..., None] * 2.0
    idx = np.argsort(-scores, axis=-1)[..., : c.K].astype(np.int32)
    if c.masked:
        idx[rng.random(idx.shape) < c.masked] = -1
    if c.ragged:
        for r in range(R):
            idx[r, max(1, c.M - r):] = -1
    return idx


def make_x(rng, c: Case, shape):
    if c.dtype == "float8_e4m3fn":
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN payloads
        return b.view(jnp.float8_e4m3fn)
    return rng.standard_normal(shape).astype(np.float32).astype(np.dtype(c.dtype))


def ref_dst_row(meta_ref, num_recv_ref, M, N):
    """[R(src), N, R(dst)] row of each source token in each dest's non-expand layout, from reference meta."""
    out = np.full((R, N, R), -1, np.int32)
    for d in range(R):
        for i in range(int(num_recv_ref[d])):
            g = int(meta_ref[d, i, 0])
            out[g // M, g % M, d] = i
    return out


def _ref_key(c: Case) -> str:
    import hashlib
    src = _REF_SRC + Path(__file__).read_bytes()
    return f"{c.name}_R{R}_" + hashlib.sha1(repr(c).encode() + src).hexdigest()[:16]


def cached_reference(c: Case, compute):
    """Reference results of a case: computed here, or (with --ref-dir) by process 0 once and shared."""
    if not args.ref_dir:
        return compute()
    path = Path(args.ref_dir) / (_ref_key(c) + ".npz")
    if not path.exists() and jax.process_index() == 0:
        res = compute()
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        special = {k: v.dtype.name for k, v in res.items() if v.dtype.name in ("bfloat16", "float8_e4m3fn")}
        np.savez(tmp, **{k: (bits(v) if k in special else v) for k, v in res.items()},
                 __special__=np.array([f"{k}:{d}" for k, d in special.items()] or [""]))
        os.replace(tmp, path)
    deadline = time.time() + 600
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"reference file {path} not written by process 0")
        time.sleep(0.05)
    with np.load(path) as z:
        special = dict(e.split(":") for e in z["__special__"].tolist() if e)
        return {k: (z[k].view(jnp.dtype(special[k])) if k in special else z[k]) for k in z.files
                if k != "__special__"}


def run_case(ctx, c: Case):
    rng = np.random.default_rng(c.seed + 1000 * R)
    E = c.E_loc * R
    N, H, K, M = c.M, c.H, c.K, c.M
    idx = make_routing(rng, c, E)
    x = make_x(rng, c, (R, N, H))
    x2 = make_x(rng, c, (R, N, H))
    w = rng.standard_normal((R, N, K)).astype(np.float32)
    w2 = rng.standard_normal((R, N, K)).astype(np.float32)
    sf = rng.standard_normal((R, N, c.P)).astype(np.float32) if c.P else None
    sf2 = rng.standard_normal((R, N, c.P)).astype(np.float32) if c.P else None
    rows = ep.expand_rows(R, M, K, c.E_loc, c.A) if c.expand else R * M
    y = rng.standard_normal((R, rows, H)).astype(np.float32).astype(jnp.bfloat16)
    cw = rng.standard_normal((R, rows) if c.expand else (R, R * M, K)).astype(np.float32)
    biases = [rng.standard_normal((R, N, H)).astype(np.float32).astype(jnp.bfloat16) for _ in range(c.nbias)]

    kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=c.expand, expert_alignment=c.A,
              zero_padding=c.zp, num_sms=c.sms or None)  # c.det: the order is canonical (no flag)

    def body(x, x2, idx, w, w2, sf, sf2, y, cw, *bs):
        d = ep.dispatch(x[0], idx[0], w[0] if c.weights else None, x_scales=None if sf is None else sf[0], **kw)
        cd = ep.dispatch(x2[0], None, w2[0] if c.weights else None, x_scales=None if sf2 is None else sf2[0],
                         handle=d.handle, token=d.token, **kw)
        cr = ep.combine(y[0], cd.handle, topk_weights=cw[0] if c.weights else None,
                        bias=tuple(b[0] for b in bs) or None)
        cx, cwo = cr.combined_x, cr.combined_topk_weights
        h = d.handle
        out = dict(recv_x=d.recv_x, num_recv=d.num_recv_tokens, group_sizes=d.group_sizes,
                   psum_rank=h.psum_num_recv_tokens_per_rank, psum_expert=h.psum_num_recv_tokens_per_expert,
                   unaligned=h.num_unaligned_recv_tokens_per_expert, meta=h.recv_src_metadata, dst_row=h.dst_row,
                   c_recv_x=cd.recv_x, cx=cx)
        if d.recv_x_scales is not None:
            out.update(recv_sf=d.recv_x_scales, c_recv_sf=cd.recv_x_scales)
        if d.recv_topk_idx is not None:
            out.update(recv_topk=d.recv_topk_idx)
        if c.weights:
            out.update(recv_w=d.recv_topk_weights, c_recv_w=cd.recv_topk_weights, cw=cwo)
        return {k: v[None] for k, v in out.items()}

    ins = [shard(x), shard(x2), shard(idx), shard(w), shard(w2), shard(sf) if c.P else None,
           shard(sf2) if c.P else None, shard(y), shard(cw)] + [shard(b) for b in biases]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    t0 = time.time()
    out = {k: local(v) for k, v in f(*ins).items()}
    t1 = time.time()

    def compute_reference():
        kwr = dict(num_experts=E, max_tokens_per_rank=M, expand=c.expand, expert_alignment=c.A, zero_padding=c.zp)
        rd = {k: v for k, v in ref.ep_dispatch(x, idx, w, x_scales=sf, **kwr).items() if v is not None}
        rc = {k: v for k, v in ref.ep_dispatch(x2, idx, w2, x_scales=sf2, **kwr).items() if v is not None}
        rcx, rcw = ref.ep_combine(y, rd, idx, num_experts=E, max_tokens_per_rank=M, expand=c.expand,
                                  topk_weights=cw, bias=tuple(biases) or None)
        out = {f"d_{k}": v for k, v in rd.items()}
        out.update({f"c_{k}": v for k, v in rc.items()})
        out["cx"] = rcx
        if rcw is not None:
            out["cw"] = rcw
        return {k: np.asarray(v) for k, v in out.items()}

    refs = cached_reference(c, compute_reference)
    rd = {k[2:]: v for k, v in refs.items() if k.startswith("d_")}
    rc = {k[2:]: v for k, v in refs.items() if k.startswith("c_")}
    rcx, rcw = refs["cx"], refs.get("cw")
    dst_ref = ref_dst_row(rd["recv_src_metadata"], rd["num_recv_tokens"], M, N)
    if os.environ.get("EP_DEBUG"):
        print(f"TIMING ours {t1 - t0:.2f}s reference {time.time() - t1:.2f}s", flush=True)

    bad = []
    for r in out["recv_x"]:
        tv = rd["recv_token_valid"][r]
        rv = rd["recv_row_defined"][r]
        o = {k: v[r] for k, v in out.items()}

        def cmp(name, got, want):
            if not same(got, want):
                diff = np.argwhere(bits(np.asarray(got)) != bits(np.asarray(want))) if np.shape(got) == np.shape(want) \
                    else f"shape {np.shape(got)} vs {np.shape(want)}"
                bad.append(f"rank {r} {name}: first diffs {diff[:3].tolist() if hasattr(diff, 'tolist') else diff}")

        cmp("num_recv", o["num_recv"], rd["num_recv_tokens"][r])
        cmp("group_sizes", o["group_sizes"], rd["group_sizes"][r])
        cmp("psum_rank", o["psum_rank"], rd["psum_num_recv_tokens_per_rank"][r])
        cmp("psum_expert", o["psum_expert"], rd["psum_num_recv_tokens_per_expert"][r])
        cmp("unaligned", o["unaligned"], rd["num_unaligned_recv_tokens_per_expert"][r])
        ncol = K + 2 if c.expand else 2
        cmp("meta", o["meta"][tv][:, :ncol], rd["recv_src_metadata"][r][tv][:, :ncol])
        if os.environ.get("EP_DEBUG") and not same(o["meta"][tv][:, :ncol], rd["recv_src_metadata"][r][tv][:, :ncol]):
            print("DEBUGMETA", r, o["meta"][tv][:3, :2].tolist(), rd["recv_src_metadata"][r][tv][:3, :2].tolist(),
                  [idx[g // M][g % M].tolist() for g in o["meta"][tv][:3, 0]], flush=True)
        cmp("dst_row", o["dst_row"], dst_ref[r])
        cmp("recv_x", o["recv_x"][rv], rd["recv_x"][r][rv])
        cmp("cached recv_x", o["c_recv_x"][rv], rc["recv_x"][r][rv])
        if c.P:
            cmp("recv_x_scales", o["recv_sf"][rv], rd["recv_x_scales"][r][rv])
            cmp("cached recv_x_scales", o["c_recv_sf"][rv], rc["recv_x_scales"][r][rv])
        if not c.expand:
            cmp("recv_topk_idx", o["recv_topk"][tv], rd["recv_topk_idx"][r][tv])
        if c.weights:
            sel = rv if c.expand else tv
            cmp("recv_topk_weights", o["recv_w"][sel], rd["recv_topk_weights"][r][sel])
            cmp("cached recv_topk_weights", o["c_recv_w"][sel], rc["recv_topk_weights"][r][sel])
            cmp("combined_topk_weights", o["cw"], rcw[r])
        cmp("combined_x", o["cx"], rcx[r])
        if os.environ.get("EP_DEBUG") and not same(o["cx"], rcx[r]):
            dd = np.argwhere(bits(o["cx"]) != bits(rcx[r]))[:4]
            for t, j in dd:
                print("DEBUG", r, t, j, o["cx"][t, j], rcx[r][t, j], idx[r][t], dst_ref[r][t], flush=True)
                acc = np.float32(-0.0)
                for b in biases:
                    acc = np.float32(acc + np.float32(b[r][t, j]))
                mk = ref.master_positions(idx[r][t][None], E, R)[0]
                for dd_, m_ in sorted([(int(m_), d_) for d_, m_ in enumerate(np.asarray(mk)) if m_ >= 0]):
                    i = dst_ref[r][t][m_]
                    mrow = rd["recv_src_metadata"][m_][i]
                    s_ = np.float32(-0.0)
                    for k in range(K):
                        if mrow[2 + k] >= 0:
                            s_ = np.float32(s_ + np.float32(y[m_][mrow[2 + k], j]))
                    acc = np.float32(acc + np.float32(jnp.bfloat16(s_)))
                    print("  rank", m_, "sent", jnp.bfloat16(s_), "acc", acc)
                print("  numpy contract:", jnp.bfloat16(acc))
                # hypothesis: no rounding of the per-rank sums
                acc2 = np.float32(-0.0)
                for b in biases:
                    acc2 = np.float32(acc2 + np.float32(b[r][t, j]))
                for dd_, m_ in sorted([(int(m_), d_) for d_, m_ in enumerate(np.asarray(mk)) if m_ >= 0]):
                    mrow = rd["recv_src_metadata"][m_][dst_ref[r][t][m_]]
                    for k in range(K):
                        if mrow[2 + k] >= 0:
                            acc2 = np.float32(acc2 + np.float32(y[m_][mrow[2 + k], j]))
                print("  no intermediate rounding:", jnp.bfloat16(acc2), "bias", [b[r][t, j] for b in biases])
    return not bad, "; ".join(bad[:6])


def base_cases():
    """Each case is one static configuration (one compile of ours and of the reference); features that are
    only data (ragged ranks, masked ids, unbalanced routing, deterministic) are spread over them. `wide`
    cases also run with 4+ ranks (--wide-only)."""
    return [
        Case("nonexpand_f32_e8_k8_det", E_loc=8, K=8, dtype="float32", det=True, wide=True),
        Case("expand_f16_e8_k8_a1_bias1", E_loc=8, K=8, dtype="float16", expand=True, nbias=1),
        Case("expand_e8_k8_a128_zp_unbal_bias2", E_loc=8, K=8, expand=True, A=128, zp=True, nbias=2,
             unbalanced=True, wide=True),
        Case("nonexpand_e1_k1_a128_bias1_nomask", E_loc=1, K=1, M=16, A=128, nbias=1, masked=0.0, ragged=False),
        Case("expand_e1_kmax_unbal_heavymask_noweights", E_loc=1, K=min(8, R), M=16, expand=True, unbalanced=True,
             masked=0.4, weights=False),
        Case("expand_e64_k8_a128_zp_det", E_loc=64, K=8, M=12, expand=True, A=128, zp=True, det=True, wide=True),
        Case("nonexpand_e64_k1_fp8_p1_bias2", E_loc=64, K=1, M=16, dtype="float8_e4m3fn", P=1, nbias=2),
        Case("expand_e8_k8_fp8_p4_a128_zp", E_loc=8, K=8, M=16, expand=True, A=128, zp=True, dtype="float8_e4m3fn",
             P=4, wide=True),
        Case("expand_h7168_k8_bias2", E_loc=8, K=8, H=7168, M=4, expand=True, nbias=2, wide=True),
        Case("nonexpand_h7168_k8_unbal_bias1", E_loc=8, K=8, H=7168, M=4, unbalanced=True, nbias=1, wide=True),
        # non-default num_sms (the grid of both kernels; the combine takes it from the handle): fewer CTAs than
        # tokens, and more than the default 24
        Case("nonexpand_h7168_k8_sms3_bias1", E_loc=8, K=8, H=7168, M=24, nbias=1, sms=3, wide=True),
        Case("expand_e8_k8_a128_zp_sms40", E_loc=8, K=8, M=40, expand=True, A=128, zp=True, sms=40),
    ]


# ------------------------------------------------------------------------------------------------ suites
def suite_cases(ctx):
    for c in base_cases():
        if args.cases and not any(p in c.name for p in args.cases.split(",")):
            continue
        if args.wide_only and not c.wide:
            continue
        if c.K > c.E_loc * R:
            continue
        check(f"case_{c.name}", lambda c=c: run_case(ctx, c))


def suite_quick(ctx):
    check("case_quick_expand", lambda: run_case(ctx, Case("quick", expand=True, A=4, zp=True, nbias=1)))


def suite_config(ctx):
    check("ep_config_attributes_and_cache_key", lambda: _config_check(ctx))
    check("ep_config_type_errors", _config_type_check)
    check("ep_config_handler_safety_net", _config_safety_net_check)


def _config_check(ctx):
    """An EPConfig reaches the handlers as attributes of the custom calls (the per-op config over the context's), so
    a new config compiles anew; the results do not change. The dispatch's config also rules its combine."""
    E, K, M, H = 4 * R, 2, 8, 128

    def make(config):
        def body(x, idx):
            d = ep.dispatch(x[0], idx[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M, config=config)
            y, _ = ep.combine(d.recv_x, d.handle)
            return y[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))

    rng = np.random.default_rng(3)
    x = shard(rng.standard_normal((R, M, H)).astype(jnp.bfloat16))
    idx = shard(np.stack([rng.permutation(E)[:K] for _ in range(R * M)]).reshape(R, M, K).astype(np.int32))
    cfg = je.EPConfig(dispatch_copy_engine="never", dispatch_stage_warps=5, combine_stage_warps=11)
    f_default, f_cfg = make(None), make(cfg)
    hlo = f_cfg.lower(x, idx).as_text()
    for want in ("stage_warps = 5", "stage_warps = 11", "copy_pieces = 0"):
        if want not in hlo:
            return False, f"{want!r} not among the custom calls' attributes"
    if "stage_warps = 0" not in f_default.lower(x, idx).as_text():
        return False, "the default config does not pass stage_warps = 0"
    a, b = local(f_default(x, idx)), local(f_cfg(x, idx))
    same = sorted(a) == sorted(b) and all(np.array_equal(a[r].view(np.uint16), b[r].view(np.uint16)) for r in a)
    path = ctx.dispatch_path(max_tokens_per_rank=M, hidden_bytes=H * 2, topk=K, num_experts=E, config=cfg)
    want_path = "pull (CPU)" if ctx.platform == "cpu" else "SM stores"
    return same and path == want_path, f"path={path}, same results: {same}"


def _config_safety_net_check():
    """The handlers check the tuning attributes again (a safety net behind Python's validation): a dispatch asking
    for copy-engine rows on CPU, or for more push warps than a CTA has on CUDA, fails naming the attribute."""
    from jax_engram import _call

    E, K, M, H = 4 * R, 2, 8, 128
    real = _call.call
    cpu = devices[0].platform == "cpu"
    bad, needle = (("copy_pieces", 3), "no copy-engine path") if cpu else (("stage_warps", 16), "stage_warps=16")

    def patched(ctx_, tgt, results, *ops, **attrs):
        if tgt.startswith("jax_engram_ep_dispatch"):
            attrs[bad[0]] = bad[1]
        return real(ctx_, tgt, results, *ops, **attrs)

    c = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)

    def body(x, i):
        return ep.dispatch(x[0], i[0], ctx=c, num_experts=E, max_tokens_per_rank=M).recv_x[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    x = np.ones((R, M, H), jnp.bfloat16)
    idx = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
    _call.call = patched
    try:
        return expect_error(lambda: jax.block_until_ready(f(shard(x), shard(idx))), needle)
    finally:
        _call.call = real
        c.close()


def _config_type_check():
    ok1, m1 = expect_error(lambda: je.init(mesh, "ep", ep_config={"copy_engine_pieces": 3}),
                           "ep_config must be a jax_engram.EPConfig")
    return ok1, m1


def suite_cache(ctx):
    check("jit_cache_hit_when_token_count_changes", lambda: _cache_check(ctx))


def _cache_check(ctx):
    """The real token count is data: changing which rows are masked must not retrace / recompile."""
    E, K, M, H = 4 * R, 2, 16, 128
    traces = []

    def body(x, idx):
        traces.append(1)
        d = ep.dispatch(x[0], idx[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=True,
                        expert_alignment=8, zero_padding=True)
        cx = ep.combine(d.recv_x, d.handle).combined_x
        return d.num_recv_tokens[None], cx[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((R, M, H)).astype(jnp.bfloat16)
    counts = []
    for frac in (0.0, 0.5, 0.9):
        idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(R)]).astype(np.int32)
        idx[rng.random(idx.shape) < frac] = -1
        n, cx = f(shard(x), shard(idx))
        counts.append(sorted(int(v) for v in local(n).values()))
        # combine(dispatch(x)) = x * (number of routed (token, k)); with K = 2 every partial sum is exact
        for r, got in local(cx).items():
            nk = (idx[r] >= 0).sum(-1)
            want = np.where(nk[:, None] > 0, x[r].astype(np.float32) * nk[:, None], 0.0).astype(jnp.bfloat16)
            if not same(got, want):
                return False, f"combine(dispatch(x)) wrong on rank {r} (mask fraction {frac})"
    ok = len(traces) == 1 and f._cache_size() == 1 and len({tuple(c) for c in counts}) > 1
    return ok, f"traces={len(traces)} cache={f._cache_size()} counts={counts}"


def suite_lanes(ctx):
    check("lanes_interleaved", lambda: _lanes_check(ctx))
    check("call_after_close_fails_cleanly", _after_close_check)


def _after_close_check():
    """A compiled function of a closed context must fail with an error, not run: with cuda_graphs a replayed graph
    would launch kernels into the freed windows, so close() drops JAX's compiled executables and the call retraces."""
    c2 = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout, cuda_graphs=args.cuda_graphs)
    E, M, H = 4 * R, 8, 128

    def body(x, i):
        d = ep.dispatch(x[0], i[0], ctx=c2, num_experts=E, max_tokens_per_rank=M)
        y = ep.combine(d.recv_x, d.handle).combined_x
        return y[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    xs = shard(np.ones((R, M, H), jnp.bfloat16))
    ids = shard(np.tile(np.array([[0, 1]], np.int32), (R, M, 1)))
    try:
        jax.block_until_ready(f(xs, ids))
        c2.check()
    finally:
        c2.close()
    return expect_error(lambda: jax.block_until_ready(f(xs, ids)), "closed")


def _lanes_check(ctx):
    """Two configs interleaved in one jitted loop: a large one (on 2 GPUs the auto policy moves its rows with the
    copy engine: dispatch lane 0, host-counted) and a small one (SM stores: with cuda_graphs, the graph targets and
    lane 1, replayed without the handler). Each lane's sequence must stay whole whatever the other does (ep_layout.h
    "dispatch lanes"). Checked: combine(dispatch(x)) and combine(cached dispatch(x2)) against numpy, every iteration's
    result kept."""
    rng = np.random.default_rng(11)
    cfgs = {"big": dict(M=320, H=7168, E=32 * R, K=8), "small": dict(M=16, H=128, E=4 * R, K=4)}
    data = {}
    for name, c in cfgs.items():
        idx = np.stack([np.stack([rng.permutation(c["E"])[:c["K"]] for _ in range(c["M"])]) for _ in range(R)])
        idx = idx.astype(np.int32)
        idx[rng.random(idx.shape) < 0.1] = -1
        x = rng.standard_normal((R, c["M"], c["H"])).astype(jnp.bfloat16)
        data[name] = (x, idx)
    iters = 3

    def body(xb, ib, xs, i_s):
        xb, ib, xs, i_s = xb[0], ib[0], xs[0], i_s[0]
        kb = dict(ctx=ctx, num_experts=cfgs["big"]["E"], max_tokens_per_rank=cfgs["big"]["M"])
        ks = dict(ctx=ctx, num_experts=cfgs["small"]["E"], max_tokens_per_rank=cfgs["small"]["M"])

        def step(i, carry):
            tok, ob, os1, os2 = carry
            db = ep.dispatch(xb, ib, token=tok, **kb)
            ds = ep.dispatch(xs, i_s, token=db.token, **ks)
            dc = ep.dispatch(xs * 2, handle=ds.handle, token=ds.token, **ks)
            rb = ep.combine(db.recv_x, db.handle, token=dc.token)
            r1 = ep.combine(ds.recv_x, ds.handle, token=rb.token)
            r2 = ep.combine(dc.recv_x, ds.handle, token=r1.token)
            cb, c1, c2, tok = rb.combined_x, r1.combined_x, r2.combined_x, r2.token
            return tok, ob.at[i].set(cb), os1.at[i].set(c1), os2.at[i].set(c2)

        def z(shape, dtype):  # varying along "ep", like the ops' outputs
            return jax.lax.pcast(jnp.zeros(shape, dtype), "ep", to="varying")
        tok0 = z((), jnp.float32)
        _, ob, os1, os2 = jax.lax.fori_loop(0, iters, step, (tok0, z((iters,) + xb.shape, xb.dtype), z((iters,) + xs.shape, xs.dtype),
                                                            z((iters,) + xs.shape, xs.dtype)))
        return ob[None], os1[None], os2[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    outs = f(*(shard(a) for name in ("big", "small") for a in data[name]))
    ob, os1, os2 = (local(o) for o in outs)

    def want(x, idx, E, scale=1.0):
        # non-expand: each rank that a token reaches returns x once; fp32 sum, one bf16 rounding
        hits = np.stack([((idx >= 0) & (idx // (E // R) == d)).any(-1) for d in range(R)], -1).sum(-1)
        return (x.astype(np.float32) * scale * hits[:, None]).astype(jnp.bfloat16)

    Eb, Es = cfgs["big"]["E"], cfgs["small"]["E"]
    for r in ob:
        wb = want(data["big"][0][r], data["big"][1][r], Eb)
        ws1 = want(data["small"][0][r], data["small"][1][r], Es)
        ws2 = want(data["small"][0][r], data["small"][1][r], Es, 2.0)
        for it in range(iters):
            for what, got, w in (("big", ob[r][it], wb), ("small", os1[r][it], ws1), ("small cached", os2[r][it], ws2)):
                if not same(got, w):
                    return False, f"{what} combine(dispatch(x)) wrong on rank {r}, iteration {it}"
    paths = {name: ctx.dispatch_path(max_tokens_per_rank=c["M"], hidden_bytes=c["H"] * 2, topk=c["K"],
                                     num_experts=c["E"]) for name, c in cfgs.items()}
    return True, f"paths={paths}"


def expect_error(fn, *needles):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        return not missing, f"missing {missing} in: {msg[:600]}"
    return False, "no error raised"


def suite_errors(_ctx_unused):
    E, K, M, H = 2 * R, 2, 8, 128

    def run_bad(idx_full, needles, detail):
        ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)
        try:
            f = jax.jit(jax.shard_map(
                lambda x, i: ep.dispatch(x[0], i[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M).recv_x[None],
                mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            x = np.ones((R, M, H), jnp.bfloat16)

            def go():  # GPU kernels record the error; the next op / ctx.check() raises it
                jax.block_until_ready(f(shard(x), shard(idx_full)))
                ctx.check()

            ok, msg = expect_error(go, *needles)
            if not ok and devices[0].platform != "cpu":  # generic device-error text: detail = token*64 + kind
                ok2, msg2 = expect_error(go, f"detail {detail}")
                return ok2, msg + " / " + msg2
            return ok, msg
        finally:
            ctx.close()

    good = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
    dup = good.copy()
    dup[0, 3] = [1, 1]
    check("error_duplicate_expert_names_token",
          lambda: run_bad(dup, ["token 3", "expert 1", "more than once"], 3 * 64 + 1))
    oob = good.copy()
    oob[R - 1, 5, 1] = E
    check("error_expert_out_of_range", lambda: run_bad(oob, ["token 5", f"expert id {E}", "outside [-1"], 5 * 64 + 2))
    neg = good.copy()
    neg[0, 2, 0] = -7
    check("error_expert_below_minus_one", lambda: run_bad(neg, ["token 2", "expert id -7"], 2 * 64 + 2))

    def too_small():
        ctx = je.init(mesh, "ep", ep_config=EPC, device_bytes=1 << 20, timeout_s=args.timeout)
        try:
            Mb = 4096  # staging needs 2 * 4096 * 7168 * 2 bytes > 1 MiB
            f = jax.jit(jax.shard_map(
                lambda x, i: ep.dispatch(x[0], i[0], ctx=ctx, num_experts=E, max_tokens_per_rank=Mb).recv_x[None],
                mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            spec = [jax.ShapeDtypeStruct((R, 8, 7168), jnp.bfloat16, sharding=NamedSharding(mesh, SPEC)),
                    jax.ShapeDtypeStruct((R, 8, K), jnp.int32, sharding=NamedSharding(mesh, SPEC))]
            need = ep.dispatch_staging_bytes(R, Mb, K, E, 7168 * 2, 0, push=ctx.platform != "cpu")
            return expect_error(lambda: f.trace(*spec), "EP dispatch buffer", str(need), "device_bytes")
        finally:
            ctx.close()

    check("error_window_too_small_names_bytes", too_small)
    check("error_init_cuda_graphs_not_bool",
          lambda: expect_error(lambda: je.init(mesh, "ep", ep_config=EPC, cuda_graphs="yes"), "cuda_graphs must be a bool"))

    # Trace-time validation: messages name the argument.
    ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)
    try:
        def trace(fn, *shapes):
            specs = [jax.ShapeDtypeStruct((R,) + s[0], s[1], sharding=NamedSharding(mesh, SPEC)) for s in shapes]
            return jax.jit(jax.shard_map(lambda *a: fn(*[v[0] for v in a]), mesh=mesh, in_specs=SPEC,
                                         out_specs=SPEC)).trace(*specs)

        bf, i32 = jnp.bfloat16, jnp.int32
        kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M)
        tests = {
            "val_n_gt_m": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None], [((M + 1, H), bf), ((M + 1, K), i32)],
                           ["max_tokens_per_rank"]),
            "val_experts_multiple": (lambda x, i: ep.dispatch(x, i, **{**kw, "num_experts": 2 * R + 1}).recv_x[None],
                                     [((M, H), bf), ((M, K), i32)], ["num_experts", "multiple"]),
            "val_zero_padding": (lambda x, i: ep.dispatch(x, i, zero_padding=True, **kw).recv_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["zero_padding", "expand"]),
            "val_fp8_needs_scales": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None],
                                     [((M, H), jnp.float8_e4m3fn), ((M, K), i32)], ["x_scales"]),
            "val_topk_dtype": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None],
                               [((M, H), bf), ((M, K), jnp.float32)], ["topk_idx", "int32"]),
            "val_topk_gt_32": (lambda x, i: ep.dispatch(x, i, **{**kw, "num_experts": 64 * R}).recv_x[None],
                               [((M, H), bf), ((M, 33), i32)], ["top-k", "32"]),
            "val_weights_shape": (lambda x, i: ep.dispatch(x, i, jnp.zeros((M, K + 1), jnp.float32), **kw).recv_x[None],
                                  [((M, H), bf), ((M, K), i32)], ["topk_weights", "[N, K]"]),
            "val_combine_rows": (lambda x, i: ep.combine(x, ep.dispatch(x, i, **kw).handle).combined_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["y must be", str(R * M)]),
            "val_combine_handle": (lambda x, i: ep.combine(x, None).combined_x[None], [((M, H), bf), ((M, K), i32)],
                                   ["handle", "EPHandle"]),
            "val_combine_bias": (lambda x, i: ep.combine(jnp.zeros((R * M, H), bf), ep.dispatch(x, i, **kw).handle,
                                                         bias=jnp.zeros((M, H + 1), bf)).combined_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["bias[0]", "[N, H]"]),
            "val_cached_config": (lambda x, i: ep.dispatch(x, None, handle=ep.dispatch(x, i, **kw).handle,
                                                           **{**kw, "expand": True}).recv_x[None],
                                  [((M, H), bf), ((M, K), i32)], ["handle", "expand"]),
        }
        for name, (fn, shapes, needles) in tests.items():
            check(name, lambda fn=fn, shapes=shapes, needles=needles: expect_error(lambda: trace(fn, *shapes), *needles))
    finally:
        ctx.close()

    # Handler-level validation (handlers/validate.h, shared by both backends): the Python layer always asks for the
    # right result shapes, so one is made wrong on its way to ffi_call; the handler must refuse it and name it.
    from jax_engram import _call
    # with --cuda-graphs on GPU: the graph targets, whose refusal comes while XLA captures them
    graphs = args.cuda_graphs and devices[0].platform == "gpu"

    def handler_rejects(target, index, needles, expand=False):
        real = _call.call
        target = target + "_graph" if graphs else target

        def patched(ctx_, tgt, results, *ops, **attrs):
            if tgt == target:
                results = list(results)
                r = results[index]
                results[index] = r.update(shape=(r.shape[0] + 1,) + tuple(r.shape[1:]))
            return real(ctx_, tgt, results, *ops, **attrs)

        ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout, cuda_graphs=graphs)
        kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=expand)

        def body(x, i):
            d = ep.dispatch(x[0], i[0], **kw)
            c = ep.dispatch(x[0], None, handle=d.handle, **kw)
            if target.startswith("jax_engram_ep_dispatch_cached"):  # its bad result would fail combine's own trace-time check
                return c.recv_x[None]
            y = ep.combine(c.recv_x, d.handle).combined_x
            return y[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
        x = np.ones((R, M, H), jnp.bfloat16)
        idx = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
        _call.call = patched
        try:
            return expect_error(lambda: jax.block_until_ready(f(shard(x), shard(idx))), *needles)
        finally:
            _call.call = real
            ctx.close()

    check("handler_dispatch_recv_x_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch", 0, ["recv_x must have shape"]))
    check("handler_dispatch_dst_row_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch", 8, ["dst_row must have shape", f"[{M},{R}]"]))
    check("handler_cached_recv_x_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch_cached", 0, ["recv_x must have shape"], expand=True))
    check("handler_combine_combined_x_shape",
          lambda: handler_rejects("jax_engram_ep_combine", 0, ["combined_x must have shape", f"[{M},{H}]"]))


def load_example():
    spec = importlib.util.spec_from_file_location("moe_layer", REPO / "examples" / "moe_layer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def suite_grad(ctx):
    ex = load_example()
    for dtype, tol in (("float32", 2e-5), ("bfloat16", 3e-2)):
        check(f"moe_grad_{dtype}", lambda dtype=dtype, tol=tol: ex.check_against_reference(
            ctx, mesh, dtype=dtype, tol=tol, seed=3))


def suite_grad_nonexpand(ctx):
    """Gradients of dispatch (non-expand) / combine w.r.t. x, weights, y, bias vs the reference's autodiff."""
    E, K, M, H = 4 * R, 3, 12, 32
    rng = np.random.default_rng(11)
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.15] = -1
    x = rng.standard_normal((R, M, H)).astype(np.float32)
    w = rng.standard_normal((R, M, K)).astype(np.float32)
    b = rng.standard_normal((R, M, H)).astype(np.float32).astype(jnp.bfloat16)
    g1 = rng.standard_normal((R, R * M, H)).astype(np.float32)
    g2 = rng.standard_normal((R, M, H)).astype(np.float32)
    g3 = rng.standard_normal((R, R * M, K)).astype(np.float32)
    g4 = rng.standard_normal((R, M, K)).astype(np.float32)
    kw = dict(num_experts=E, max_tokens_per_rank=M)

    def ours(x, w, b, idx, g1, g2, g3, g4):
        def body(x, w, b, idx, g1, g2, g3, g4):
            d = ep.dispatch(x[0], idx[0], w[0], ctx=ctx, **kw)
            # Rows past num_recv_tokens are unspecified (the contract): mask them like recv_x below. The CPU
            # backend happens to zero them; on GPU they hold whatever XLA's buffer held.
            valid = (jnp.arange(R * M) < d.num_recv_tokens)[:, None]
            local_k = (d.recv_topk_idx >= 0) & valid
            rw = jnp.where(local_k, d.recv_topk_weights, 0.0)
            y = (jnp.where(valid, d.recv_x, 0.0) * (1.0 + rw.sum(-1, keepdims=True))).astype(jnp.bfloat16)
            cr = ep.combine(y, d.handle, topk_weights=rw * 2.0, bias=b[0])
            cx, cw = cr.combined_x, cr.combined_topk_weights
            loss = (jnp.sum(jnp.where(valid, d.recv_x, 0.0) * g1[0]) + jnp.sum(cx.astype(jnp.float32) * g2[0])
                    + jnp.sum(rw * g3[0]) + jnp.sum(cw * g4[0]))
            return loss[None]
        # One loss per rank and a vjp with ones: the gradient of the sum over ranks without an XLA collective (an
        # all-reduce would need NCCL, which cannot run when several ranks share a GPU).
        f = jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC)
        return f(x, w, b, idx, g1, g2, g3, g4)

    def theirs(x, w, b, idx, g1, g2, g3, g4):
        d = ref.ep_dispatch(x, idx, w, **kw)
        rt = jnp.asarray(d["recv_topk_idx"])
        rw = jnp.where(rt >= 0, d["recv_topk_weights"], 0.0)
        valid = d["recv_token_valid"][..., None]
        y = (jnp.where(valid, d["recv_x"], 0.0) * (1.0 + rw.sum(-1, keepdims=True))).astype(jnp.bfloat16)
        cx, cw = ref.ep_combine(y, d, idx, expand=False, topk_weights=rw * 2.0, bias=b, **kw)
        per_rank = lambda a: a.reshape(R, -1).sum(-1)  # noqa: E731
        return (per_rank(jnp.where(valid, d["recv_x"], 0.0) * g1) + per_rank(cx.astype(jnp.float32) * g2)
                + per_rank(rw * g3) + per_rank(cw * g4))

    @jax.jit
    def ours_vjp(x, w, b, idx, g1, g2, g3, g4):
        loss, pull = jax.vjp(lambda x, w, b: ours(x, w, b, idx, g1, g2, g3, g4), x, w, b)
        return loss, pull(jnp.ones_like(loss))

    def run():
        args_ = [shard(v) for v in (x, w, b, idx, g1, g2, g3, g4)]
        l1, (dx1, dw1, db1) = ours_vjp(*args_)
        l2, (dx2, dw2, db2) = jax.jit(jax.value_and_grad(lambda *a: theirs(*a).sum(), argnums=(0, 1, 2)))(
            x, w, b, idx, g1, g2, g3, g4)
        l2_rank = np.asarray(jax.jit(theirs)(x, w, b, idx, g1, g2, g3, g4))
        errs = []
        for name, a, bb in (("dx", dx1, dx2), ("dw", dw1, dw2), ("dbias", db1, db2)):
            for r, got in local(a).items():
                want = np.asarray(bb[r]).astype(np.float32)
                got = got.astype(np.float32)
                scale = max(1.0, float(np.abs(want).max()))
                if not np.allclose(got, want, atol=2e-2 * scale, rtol=2e-2):
                    errs.append(f"{name} rank {r}: max err {np.abs(got - want).max()} (scale {scale})")
        for r, got in local(l1).items():
            if not np.isclose(float(got), float(l2_rank[r]), rtol=1e-2, atol=1e-1):
                errs.append(f"loss rank {r}: {float(got)} vs {float(l2_rank[r])}")
        return not errs, "; ".join(errs)

    check("grad_nonexpand_dispatch_combine", run)


def suite_example(_ctx):
    ex = load_example()
    check("example_runs", lambda: (ex.main(["--tokens", "16", "--quiet", "--dtypes", "float32"]) == 0, ""))


SUITES = {"cases": suite_cases, "quick": suite_quick, "cache": suite_cache, "errors": suite_errors,
          "config": suite_config,
          "grad": suite_grad, "gradne": suite_grad_nonexpand, "lanes": suite_lanes, "example": suite_example}
want = args.suite.split(",")
if "full" in want:
    want = ["cases", "cache", "gradne", "grad", "lanes", "config", "errors"]
ctx = je.init(mesh, AX, ep_config=EPC, timeout_s=args.timeout, cuda_graphs=args.cuda_graphs)
dispatch_path = None
graph_captures = None
try:
    for s in want:
        if s == "errors" or s == "example":
            continue
        SUITES[s](ctx)
    ctx.check()
    # how dispatch moves rows for a small case on this machine (tests that force the copy engine assert it)
    dispatch_path = ctx.dispatch_path(max_tokens_per_rank=4, hidden_bytes=256, topk=8, num_experts=8 * R)
    graph_captures = ctx.graph_captures()
finally:
    ctx.close()
for s in want:
    if s in ("errors", "example"):
        SUITES[s](None)

failed = [k for k, v in results.items() if not v]
print(f"SUMMARY ep_check: {len(results) - len(failed)} passed, {len(failed)} failed ({devices[0].platform}, {R} ranks, "
      f"{jax.process_count()} processes, {time.time() - T0:.1f}s){' FAILED: ' + ', '.join(failed) if failed else ''}",
      flush=True)
launch.emit_result({"checks": results, "devices": R, "processes": jax.process_count(),
                    "platform": devices[0].platform, "dispatch_path": dispatch_path,
                    "graph_captures": graph_captures, "hierarchical": bool(getattr(ctx, "hierarchical", False))})
launch.shutdown()
sys.exit(0 if all(results.values()) and results else 1)
