"""The suites of ep_check.py: common (arguments, setup, mesh, helpers), cases (the bit-exact case matrix),
behaviour (EPConfig, jit cache, interleaved dispatch sequences, calls after close), errors, grads (gradients, the example)."""
