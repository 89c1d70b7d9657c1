"""EP dispatch / combine checks on any platform, bit-exact against jax_engram.reference.

Standalone (one process over all local devices):   python tests/workers/ep_check.py [--platform cpu --cpu-devices 4]
Under the launcher:                                python -m jax_engram.launch -n 2 [--platform cuda] tests/workers/ep_check.py
Options: --suite full|quick|grad|errors|cache|sequences|example (comma-separated), --cases SUBSTR (filter case names),
--cuda-graphs (the context's cuda_graphs=True; with XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 XLA captures every EP
op it may into a CUDA graph, and the RESULT line reports how many were captured).
Prints `CHECK <name> PASS|FAIL <detail>` lines and one `RESULT <json>` line ({"checks": {name: bool}, ...}).

Every case runs, in one jitted shard_map: dispatch -> cached dispatch (new x / weights, handle of the first)
-> combine (random y over ALL rows, so rows the combine must not read hold garbage). Compared: every defined
row (valid rows; zero-padding rows when requested), counts and psums, metadata, dst_row (against the
reference row of each source token), the cached outputs, combined_x (bit-exact) and combined_topk_weights.

The suites live in _ep_check/ (common: arguments, setup, mesh; cases; behaviour: config, cache, sequences; errors;
grads: grad, gradne, example); this script picks and runs them.
"""
from __future__ import annotations

import sys
import time

from _ep_check.common import AX, EPC, R, T0, args, checks, devices, jax, je, launch, mesh, results
from _ep_check.behaviour import suite_cache, suite_config, suite_sequences
from _ep_check.cases import suite_cases, suite_quick
from _ep_check.errors import suite_errors
from _ep_check.grads import suite_example, suite_grad, suite_grad_nonexpand

SUITES = {"cases": suite_cases, "quick": suite_quick, "cache": suite_cache, "errors": suite_errors,
          "config": suite_config,
          "grad": suite_grad, "gradne": suite_grad_nonexpand, "sequences": suite_sequences, "example": suite_example}
want = args.suite.split(",")
if "full" in want:
    want = ["cases", "cache", "gradne", "grad", "sequences", "config", "errors"]
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

checks.summary("ep_check", devices[0].platform, f"{R} ranks", f"{jax.process_count()} processes",
               f"{time.time() - T0:.1f}s")
launch.emit_result({"checks": results, "devices": R, "processes": jax.process_count(),
                    "platform": devices[0].platform, "dispatch_path": dispatch_path,
                    "graph_captures": graph_captures, "hierarchical": isinstance(ctx, je.HierContext)})
launch.shutdown()
sys.exit(0 if all(results.values()) and results else 1)
