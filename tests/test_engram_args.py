"""Bad arguments to EngramTable.write / fetch / wait are refused with the same message on a flat group and on a
("node", "gpu") group (tests/workers/engram_args_check.py: 4 CPU devices, as 4 ranks and as 2 nodes x 2), and the
tables stay usable afterwards."""
from __future__ import annotations

import pytest

from conftest import assert_same_message, run_worker

# case -> words its message must contain (the user's arguments and the table's numbers)
NEEDLES = {
    "write_storage_shape": ["ValueError", "storage must be [n, hidden] rows of this rank's shard", "[8, 4]", "(9, 4)"],
    "write_row_offset": ["ValueError", "row_offset 4 puts the 5 rows outside the shard of 8 rows", "<= 3"],
    "write_storage_dtype": ["TypeError", "storage dtype bfloat16", "float32"],
    "write_without_sf": ["ValueError", "num_sf_packs=1: pass sf", "[32, 1]"],
    "write_sf_shape": ["ValueError", "sf must be the scale factors of the written rows of every rank", "(31, 1)"],
    "write_sf_dtype": ["TypeError", "sf dtype int32"],
    "fetch_ids_rank": ["ValueError", "indices must be [num_tokens, ids_per_token]", "(6,)"],
    "fetch_ids_float": ["TypeError", "indices must be an integer array", "float32"],
    "fetch_mode": ["ValueError", "EngramTable.fetch: mode must be one of", "'wrap'"],
    "fetch_sf_layout": ["ValueError", "EngramTable.fetch: sf_layout must be one of", "'col'"],
    "fetch_config": ["TypeError", "config must be a jax_engram.EngramConfig"],
    "wait_not_pending": ["TypeError", "expected the EngramPending"],
}


@pytest.fixture(scope="module")
def result():
    return run_worker("engram_args_check.py")


def test_every_case_ran(result):
    assert sorted(result["cases"]) == sorted(NEEDLES), sorted(result["cases"])


@pytest.mark.parametrize("case", sorted(NEEDLES))
def test_same_message_on_flat_and_node_gpu_groups(result, case):
    assert_same_message(result, case, NEEDLES[case])


def test_tables_stay_usable(result):
    assert result["usable"] == {"flat": True, "hier": True}, result["usable"]
