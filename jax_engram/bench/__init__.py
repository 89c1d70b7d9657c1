"""Benchmark reports: ``python -m jax_engram.bench engram|ep|model|all``.

Runs the benchmark scripts (``benchmarks/bench_engram.py``, ``benchmarks/bench_ep.py``, ``benchmarks/bench_model.py``) in a subprocess each,
shows a progress bar while they measure, then prints a table, and writes into ``--out-dir``: the scripts' JSON
(``engram.json``, ``ep.json``), their full output (``engram.log``, ``ep.log``) and PNG plots of latency and
bandwidth against size with the same run's ceilings and JAX baselines on the same axes (``engram_device.png``,
``engram_host.png``, ``ep_dispatch.png``, ``ep_combine.png``). :mod:`jax_engram.bench.report` makes the
tables and plots from a JSON alone (``--replot``).

The scripts are found in the source checkout next to the package (``benchmarks/``), else in the copy the wheel
installs (``jax_engram/bench/scripts/``), else at ``--scripts DIR``.
"""
from jax_engram.bench.report import engram_table, ep_table, model_table, plot_engram, plot_ep, plot_model

__all__ = ["engram_table", "ep_table", "model_table", "plot_engram", "plot_ep", "plot_model"]
