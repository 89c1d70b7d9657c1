"""Where a GPU step's time goes, from a ``jax.profiler`` trace (``create_perfetto_trace=True``): per GPU stream, the
span, the time busy and the idle gaps, the largest gaps with the activities on both sides, and the other streams'
activities. Used to compare ``bench_model.py --profile`` variants (e.g. Engram rows resident vs prefetched).
``--kernels CALLS``: instead, the GPU time per activity name over every GPU stream, divided by the CALLS calls
the trace recorded (which kernels an op is made of, e.g. ``bench_ep.py --one-rank --profile``).
``--steps``: instead, one line per execution of a jitted program (the host's ``GpuExecutable::ExecuteThunks``), in
µs from its start: its first GPU activity, the first activity named ``--mark`` (e.g. a layer's first kernel), the
end of its GPU work, the time from that end to the next execution (the host's turnaround when calls are timed one
by one), and on the launching thread each custom call and each CUDA graph launch as start+duration. A GPU
activity belongs to the execution whose start precedes it, so executions enqueued back to back blur into each
other (``end`` past the next start shows it).

    python tools/profile_gaps.py PROFILE_DIR [PROFILE_DIR ...] [--top 12] [--min-gap-us 3] [--kernels CALLS]
                                 [--steps [--mark NAME]]
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def load(d: Path) -> list[dict]:
    files = sorted(d.rglob("perfetto_trace.json.gz")) or sorted(d.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto trace under {d}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def names(events: list[dict]) -> tuple[dict, dict]:
    """The trace's process names (by pid) and thread names (by (pid, tid)), from its metadata events."""
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    return pname, tname


def streams(events: list[dict]) -> dict[tuple, dict]:
    pname, tname = names(events)
    out: dict[tuple, dict] = defaultdict(lambda: {"events": []})
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        p = pname.get(e["pid"], str(e["pid"]))
        if "GPU" not in p and "gpu" not in p:
            continue
        key = (p, tname.get((e["pid"], e["tid"]), str(e["tid"])))
        out[key]["events"].append((float(e["ts"]), float(e["dur"]), e.get("name", "?")))
    for v in out.values():
        v["events"].sort()
    return dict(out)


def summarize(d: Path, top: int, min_gap: float) -> None:
    ss = streams(load(d))
    print(f"== {d}")
    if not ss:
        print("   no GPU streams found")
        return
    busy = {k: sum(du for _, du, _ in v["events"]) for k, v in ss.items()}
    main = max(busy, key=busy.get)
    t_first = ss[main]["events"][0][0]
    for key in sorted(ss, key=lambda k: -busy[k]):
        ev = ss[key]["events"]
        span = ev[-1][0] + ev[-1][1] - ev[0][0]
        gaps = []
        end, prev = ev[0][0] + ev[0][1], ev[0][2]
        for ts, du, name in ev[1:]:
            if ts - end >= min_gap:
                gaps.append((ts - end, end - t_first, prev, name))
            end, prev = max(end, ts + du), name
        gap_total = sum(g[0] for g in gaps)
        print(f"   {key[1][:60]:60s} {len(ev):5d} events  span {span:9.1f} us  busy {busy[key]:9.1f} us  "
              f"gaps >= {min_gap:g} us: {len(gaps)} = {gap_total:8.1f} us")
        if key == main:
            for g, at, a, b in sorted(gaps, reverse=True)[:top]:
                print(f"      gap {g:7.1f} us at +{at:9.1f}: after {a[:50]!r} before {b[:50]!r}")
        else:
            for ts, du, name in ev[:top]:
                print(f"      +{ts - t_first:9.1f} us  {du:7.1f} us  {name[:70]}")


def kernels(d: Path, top: int, calls: int) -> None:
    ss = streams(load(d))
    per: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for v in ss.values():
        for _, du, name in v["events"]:
            per[name][0] += 1
            per[name][1] += du
    total = sum(t for _, t in per.values())
    print(f"== {d}: GPU busy {total / calls:.1f} us per call, {sum(c for c, _ in per.values()) / calls:.1f} "
          f"activities per call ({calls} calls)")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {t / calls:9.1f} us  {c / calls:5.1f} x  {name[:100]}")


def steps(d: Path, mark: str | None) -> None:
    events = load(d)
    pname, tname = names(events)
    xs = sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: float(e["ts"]))
    is_gpu = lambda e: "GPU" in pname.get(e["pid"], "") or "gpu" in pname.get(e["pid"], "")  # noqa: E731
    runs = [e for e in xs if "ExecuteThunks" in e.get("name", "") and not is_gpu(e)]
    print(f"== {d}: {len(runs)} executions (us from each start)")
    if not runs:
        return
    gpu = [e for e in xs if is_gpu(e)]
    print("   step  first-gpu  " + (f"{mark}  " if mark else "") + "gpu-end  to-next  host: custom calls / graph launches")
    for k, r in enumerate(runs):
        t0 = float(r["ts"])
        t1 = float(runs[k + 1]["ts"]) if k + 1 < len(runs) else float("inf")
        g = [e for e in gpu if t0 <= float(e["ts"]) < t1]
        thread = (r["pid"], r["tid"])
        host = [e for e in xs if (e["pid"], e["tid"]) == thread and t0 <= float(e["ts"]) < t1
                and ("ffi_call" in e["name"] or "custom-call" in e["name"] or "cuGraphLaunch" in e["name"])]
        at = lambda e: f"{float(e['ts']) - t0:.0f}"  # noqa: E731
        first = at(g[0]) if g else "-"
        marked = next((at(e) for e in g if e.get("name") == mark), "-") if mark else None
        end = max((float(e["ts"]) + float(e["dur"]) for e in g), default=None)
        to_next = f"{t1 - end:.0f}" if end is not None and t1 != float("inf") else "-"
        pieces = " ".join(f"{'graph' if 'cuGraphLaunch' in e['name'] else e['name'][:32]}@{at(e)}+{float(e['dur']):.0f}"
                          for e in host)
        print(f"   {k:4d}  {first:>9s}  " + (f"{marked:>{len(mark)}s}  " if mark else "")
              + f"{'-' if end is None else f'{end - t0:.0f}':>7s}  {to_next:>7s}  {pieces}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min-gap-us", type=float, default=3.0)
    ap.add_argument("--kernels", type=int, default=0, metavar="CALLS",
                    help="GPU time per activity name, per call of the CALLS the trace recorded")
    ap.add_argument("--steps", action="store_true", help="one line per execution of a jitted program")
    ap.add_argument("--mark", default=None, help="--steps: also the start of the first GPU activity of this name")
    a = ap.parse_args()
    for d in a.dirs:
        if a.steps:
            steps(d, a.mark)
        elif a.kernels > 0:
            kernels(d, a.top, a.kernels)
        else:
            summarize(d, a.top, a.min_gap_us)


if __name__ == "__main__":
    main()
