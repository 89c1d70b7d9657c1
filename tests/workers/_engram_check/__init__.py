"""The cases of engram_check.py: common (arguments, setup, data and reference helpers, the case registry), lookups,
programs (ops inside one jit), gathers (gather configurations, compilation), errors (edge cases and errors)."""
