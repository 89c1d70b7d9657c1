"""How fast the host gather pool starts and finishes its jobs, from a run's stderr with ``JAX_ENGRAM_HOST_TRACE=1``
(the pool prints one line per job, runtime/host_gather.cc): per job, in µs after the job was submitted, when the
first, the median and the last worker took their first item, when the first chunk was done and when the whole job
was; printed as p10 / median / p90 over the jobs, with the jobs' sizes. A "last worker" far behind the first means
the workers woke late, and a first chunk late against its size means the stream waited for its rows.

    JAX_ENGRAM_HOST_TRACE=1 python benchmarks/bench_model.py --T 512 --modes fwd --variants resident,prefetch[cpu] \\
        --table-gib 8 --rounds 1 2> trace.log
    python tools/host_trace.py trace.log [trace_b.log ...] [--min-mib 0]
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

LINE = re.compile(
    r"jax_engram host gather: (?P<rows>\d+) rows x (?P<rb>\d+) B = (?P<mib>[0-9.]+) MiB, (?P<items>\d+) items, "
    r"(?P<chunks>\d+) chunks; submit->first item (?P<start>-?[0-9.]+) us, first item->done (?P<run>-?[0-9.]+) us "
    r"\((?P<gbps>[0-9.]+) GB/s\); (?P<workers>\d+) workers joined at \+(?P<first>-?[0-9.]+) / \+(?P<median>-?[0-9.]+) "
    r"/ \+(?P<last>-?[0-9.]+) us \(first / median / last\), chunk 0 done \+(?P<chunk0>-?[0-9.]+) us, job done "
    r"\+(?P<done>-?[0-9.]+) us")
FIELDS = (("start", "first item"), ("first", "first worker joins"), ("median", "median worker joins"),
          ("last", "last worker joins"), ("chunk0", "chunk 0 done"), ("done", "job done"))


def parse(text: str) -> list[dict]:
    return [{k: float(v) for k, v in m.groupdict().items()} for m in LINE.finditer(text)]


def quantiles(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return v[len(v) // 10], statistics.median(v), v[(9 * len(v)) // 10]


def summary(jobs: list[dict]) -> list[str]:
    if not jobs:
        return ["  no host gather jobs traced (was JAX_ENGRAM_HOST_TRACE=1 set?)"]
    mib = quantiles([j["mib"] for j in jobs])
    out = [f"  {len(jobs)} jobs of {mib[1]:.2f} MiB (p10 {mib[0]:.2f}, p90 {mib[2]:.2f}), "
           f"workers per job (median) {statistics.median(j['workers'] for j in jobs):.0f}",
           "  us after submit        p10     median        p90"]
    for key, name in FIELDS:
        vals = [j[key] for j in jobs if j[key] >= 0]  # -1: never happened (e.g. a one-chunk job has no chunk 0 flag)
        if vals:
            q = quantiles(vals)
            out.append(f"  {name:<20} {q[0]:>6.1f} {q[1]:>10.1f} {q[2]:>10.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--min-mib", type=float, default=0.0, help="only jobs of at least this many MiB")
    args = ap.parse_args()
    for log in args.logs:
        jobs = [j for j in parse(log.read_text(errors="replace")) if j["mib"] >= args.min_mib]
        print(f"{log}:")
        print("\n".join(summary(jobs)))


if __name__ == "__main__":
    main()
