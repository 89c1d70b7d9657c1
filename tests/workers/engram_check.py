"""Engram correctness matrix on whatever platform this runs on (CPU devices or GPUs; 1..N processes).

Every lookup is compared bit-exactly with ``jax_engram.reference.engram_lookup`` on the whole table
(built identically from a seed in every process). Prints one ``PASS name (s)`` / ``FAIL name: why`` line
per case and ends with ``emit_result({"passed": [...], "failed": {...}, ...})``; exits 1 if a case failed.

Run:
  under the launcher:  python -m jax_engram.launch -n 2 [--platform cuda] tests/workers/engram_check.py
  one process:         python tests/workers/engram_check.py --platform cpu --cpu-devices 4
                       python tests/workers/engram_check.py --platform cuda        (all local GPUs)
Options: --suite full|core|quick (what to run), --only SUBSTR (case names containing it), --list,
--gather default|tma|sm (the EngramConfig of every table: "tma" makes lookups use the bulk-copy gather too,
"sm" makes overlapped fetches use the full-grid gather too; --num-sms sets its SMs).

Cases (suite membership in brackets): dtype x placement with every mode and both sf layouts [full: all,
core: all dtypes host + bf16 device, quick: bf16 + fp8/col host]; E in {1, 24, 32} x hidden {64, 128};
hidden 7168 with small T (bf16, fp8 + 56 packs); rows not a multiple of 16 bytes; replicated ids;
non-int32 ids (saturating); write -> fetch in one jit; second write replaces the table (also within one
jit, ordered by the lookup's data); fetch / XLA work / wait; both gathers and their configs against each
other (many chunks per pipeline, rows larger than a chunk, small num_sms, every mode, FP8 + sf, fetch and
lookup); EngramConfig validation; jit cache when T changes; fetch before any
write; T = 0; init reservations (carving and the "too small" error); trace-time validation; checked mode
out of range (raised once by the call; the table and its context stay usable).

The cases live in _engram_check/ (common: arguments, setup, data and reference helpers, the case registry;
lookups; programs; gathers; errors); this script selects and runs them.
"""
from __future__ import annotations

import sys

from _engram_check.common import CASES, CONFIG, PLATFORM, R, args, ctx, jax
from _engram_check import lookups, programs, gathers, errors  # noqa: F401 - registers the cases, in this order
from _harness import Checks, import_launch


# ------------------------------------------------------------------------------------------- main
def main():
    sel = [(n, f) for n, s, f in CASES if args.suite in s and (args.only is None or args.only in n)]
    if args.list:
        for n, _ in sel:
            print(n)
        return 0
    info = dict(platform=PLATFORM, ranks=R, processes=jax.process_count(), local_devices=jax.local_device_count(),
                suite=args.suite, gather=args.gather, config=str(CONFIG))
    print(f"engram_check: {info}", flush=True)
    checks = Checks(style="PASS", decimals=2)
    for name, fn in sel:
        checks.expect(name, lambda fn=fn: (fn(), ctx.check()))
    ctx.close()
    checks.summary("engram_check", PLATFORM, f"{R} ranks", f"{jax.process_count()} processes", f"suite {args.suite}",
                   failed_sep=": ")
    import_launch().emit_result(dict(info, passed=checks.passed, failed=checks.errors, times=checks.times))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    rc = main()
    import_launch().shutdown()
    sys.exit(rc)
