"""DeepEP's V1 intranode Buffer timed the way benchmarks/bench_ep.py times our dispatch / combine.

Run by tools/peer_deepep.sh on the 2-GPU machine (it builds DeepEP and puts it on PYTHONPATH); one process per
GPU (torch.multiprocessing), NCCL process group, DeepEP's default dispatch / combine configs for the rank count
at ``--sms`` SMs. Per rank: x [N, H] (bf16 normal; FP8 = float8_e4m3fn with one float32 scale per 128 values, as
DeepEP takes it), top-k of normal scores (K distinct experts, uniform routing, as bench_ep), softmax weights.

Per call = the slope between loops of n and 3n back-to-back calls (CUDA events around each loop, medians of
``--iters``), as bench_ep's ``time_per_call``. Timed:
  * dispatch (worst): ``Buffer.dispatch(..., num_worst_tokens=R*N)``: static output size, no host wait -- the
    like-for-like one (our dispatch has static worst-case shapes and no host sync);
  * dispatch (synced): the default, which waits on the host for the receive count every call;
  * dispatch (layout+worst): ``get_dispatch_layout`` + the worst dispatch (ours computes its layout in the call);
  * combine: ``Buffer.combine(recv_x bf16, handle, topk_weights)``.
GB/s: logical = received rows (local rank included) x row bytes; physical = rows received from the OTHER ranks
x row bytes (what crossed NVLink into one GPU: bench_ep's "physical"), averaged over ranks. Rank 0 prints lines
starting with "peer deepep:" and writes --json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--loop", type=int, default=30)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "8391")))
    ap.add_argument("--json", default="")
    return ap.parse_args()


def _per_call_us(torch, fn, n, iters):
    """Slope between loops of n and 3n calls (CUDA events), median over iters; fn() enqueues one call."""
    def loop(m):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(m):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3
    for _ in range(2):
        loop(n)
    s1, s2 = [], []
    for _ in range(iters):
        s1.append(loop(n))
        s2.append(loop(3 * n))
    t1, t2 = statistics.median(s1), statistics.median(s2)
    return (t2 - t1) / (2 * n) if t2 > t1 else t2 / (3 * n)


def worker(rank, args):
    import torch
    import torch.distributed as dist
    R, N, H, K, E = args.ranks, args.tokens, args.hidden, args.topk, args.experts
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=R, rank=rank,
                            device_id=torch.device(f"cuda:{rank}"))
    import deep_ep
    group = dist.new_group(list(range(R)))
    buf = deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    deep_ep.Buffer.set_num_sms(args.sms)
    dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
    torch.manual_seed(1234 + rank)
    dev = "cuda"
    x = torch.randn((N, H), dtype=torch.bfloat16, device=dev)
    vals, idx = torch.topk(torch.randn((N, E), dtype=torch.float32, device=dev), K, dim=-1)
    topk_idx = idx.to(deep_ep.topk_idx_t)
    w = torch.softmax(vals, dim=-1)
    # FP8 as DeepEP takes it: e4m3 values and one float32 scale per 128 values ([N, H/128], column-major strides)
    xv = x.float().view(N, H // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    x8 = ((xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(N, H), (amax / 448.0).T.contiguous().T)

    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    all_ntpr = [torch.zeros_like(ntpr) for _ in range(R)]
    dist.all_gather(all_ntpr, ntpr, group=group)
    recv_total = sum(int(t[rank]) for t in all_ntpr)
    recv_remote = recv_total - int(all_ntpr[rank][rank])
    stats = torch.tensor([recv_total, recv_remote], dtype=torch.float64, device=dev)
    dist.all_reduce(stats, group=group)
    recv_rows, remote_rows = float(stats[0]) / R, float(stats[1]) / R

    kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=topk_idx,
              topk_weights=w, config=dcfg)
    out = dict(ranks=R, tokens=N, hidden=H, topk=K, experts=E, sms=args.sms, recv_rows=recv_rows,
               remote_rows=remote_rows, torch=torch.__version__, runs=[])
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **kw)
    y = recv_x.clone()

    # check: combine(dispatch(x)) = x * (number of ranks the token went to), as DeepEP's own test asserts
    comb, _, _ = buf.combine(y, handle, topk_weights=recv_w, config=ccfg)
    nrk = in_rank.sum(dim=1, keepdim=True).float()
    err = float(((comb.float() - x.float() * nrk).abs().max()) / x.float().abs().max())
    ok = torch.tensor([1.0 if err < 2e-2 else 0.0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    out["check_ok"], out["check_max_rel_err_rank0"] = bool(ok.item() == 1.0), err

    for dname, xin, row_b in (("bf16", x, H * 2), ("fp8", x8, H + 4 * (H // 128))):
        cases = {
            "dispatch (worst)": lambda xin=xin: buf.dispatch(xin, num_worst_tokens=R * N, **kw),
            "dispatch (synced)": lambda xin=xin: buf.dispatch(xin, **kw),
            "dispatch (layout+worst)": lambda xin=xin: (buf.get_dispatch_layout(topk_idx, E),
                                                        buf.dispatch(xin, num_worst_tokens=R * N, **kw)),
        }
        if dname == "bf16":
            cases["combine"] = lambda: buf.combine(y, handle, topk_weights=recv_w, config=ccfg)
        for what, fn in cases.items():
            dist.barrier(group=group)
            us = _per_call_us(torch, fn, args.loop, args.iters)
            rb = H * 2 if what == "combine" else row_b
            out["runs"].append(dict(op=what, dtype=dname, us=us, logical_gbps=recv_rows * rb / us / 1e3,
                                    physical_gbps=remote_rows * rb / us / 1e3))
    # ranks may differ by noise: report rank 0's timings (as bench_ep reports its host's), after all finished
    dist.barrier(group=group)
    if rank == 0:
        print(f"peer deepep: {R} ranks, tokens {N}, hidden {H}, top-{K} of {E}, {args.sms} SMs, default configs, "
              f"torch {torch.__version__}; rows received per rank {recv_rows:.0f} ({remote_rows:.0f} from the other "
              f"ranks); check {'OK' if out['check_ok'] else 'FAILED'} (combine(dispatch(x)) = x * ranks reached)",
              flush=True)
        for r in out["runs"]:
            print(f"peer deepep: {r['dtype']:4s} {r['op']:24s} {r['us']:8.1f} us  {r['logical_gbps']:6.1f} GB/s "
                  f"logical  {r['physical_gbps']:6.1f} GB/s physical", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    buf.destroy()
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    a = _args()
    mp.spawn(worker, args=(a,), nprocs=a.ranks)
