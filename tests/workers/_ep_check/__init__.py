"""The suites of ep_check.py: common (arguments, setup, mesh, helpers), cases (the bit-exact case matrix),
behaviour (EPConfig, jit cache, interleaved lanes, calls after close), errors, grads (gradients, the example)."""
