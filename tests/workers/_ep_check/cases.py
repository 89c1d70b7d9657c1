"""The bit-exact case matrix: every case runs dispatch -> cached dispatch -> combine in one jitted shard_map and
compares every defined row, count, metadata and combined row with jax_engram.reference."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import ep

from _ep_check.common import R, REF_SRC, SPEC, args, bits, check, local, mesh, ref, same, shard


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
    src = REF_SRC + Path(__file__).read_bytes()
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
                         handle=d.handle, after=d.done, **kw)
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
