"""Bad input to dispatch / combine is refused with the same message on a flat group and on a ("node", "gpu")
group (tests/workers/ep_args_check.py: 4 CPU devices, as 4 ranks and as 2 nodes x 2), and the contexts stay
usable afterwards."""
from __future__ import annotations

import pytest

from conftest import assert_same_message, run_worker

# case -> words its message must contain (the user's arguments and numbers, never a path's inner ones)
NEEDLES = {
    "topk_idx_float": ["TypeError", "topk_idx must be int32 or int64", "float32"],
    "topk_idx_shape": ["ValueError", "topk_idx must be [N=8, K]"],
    "topk_too_large": ["top-k = 33"],
    "x_dtype": ["TypeError", "x must be bfloat16"],
    "x_rank": ["x must be [num_tokens, hidden]"],
    "experts_not_multiple": ["num_experts=9", "multiple of the 4 ranks"],
    "experts_over_limit": ["num_experts=1028", "exceeds the limits"],
    "tokens_over_max": ["9 tokens", "max_tokens_per_rank=8"],
    "zero_padding_without_expand": ["zero_padding requires expand=True"],
    "fp8_without_scales": ["float8_e4m3fn x requires x_scales"],
    "scales_dtype": ["TypeError", "x_scales must be float32 or int32"],
    "scales_shape": ["x_scales must be [N=8, P]"],
    "weights_dtype": ["TypeError", "topk_weights must be float32"],
    "weights_shape": ["topk_weights must be [N, K] = (8, 2)"],
    "num_experts_not_int": ["TypeError", "num_experts must be a Python int"],
    "after_not_scalar": ["after= must be a scalar"],
    "cached_other_expand": ["different expand (handle False, here True)"],
    "cached_without_routing": ["topk_idx is required"],
    "combine_rows": ["y must be [32, hidden]"],
    "combine_dtype": ["TypeError", "y must be bfloat16"],
    "combine_handle": ["TypeError", "handle must be the EPHandle"],
    "combine_bias_shape": ["bias[0] must be [N, H] = (8, 16)"],
    "combine_bias_dtype": ["TypeError", "bias[0] must have y's dtype"],
    "combine_three_biases": ["at most two bias arrays"],
    "combine_weights_shape": ["topk_weights must be [32, 2]"],
    "x_row_not_16_bytes": ["14 bytes must be a multiple of 16"],
    "validate_routing_out_of_range": ["topk_idx of rank 3", "token 5", "expert id 8 outside [-1, num_experts=8)"],
    "validate_routing_duplicate": ["topk_idx of rank 1", "token 2", "lists expert 3 more than once"],
}


@pytest.fixture(scope="module")
def result():
    return run_worker("ep_args_check.py")


@pytest.mark.parametrize("case", sorted(NEEDLES))
def test_same_message_on_flat_and_node_gpu_groups(result, case):
    assert_same_message(result, case, NEEDLES[case])


def test_every_case_is_checked(result):
    assert set(result["cases"]) == set(NEEDLES)


@pytest.mark.parametrize("case,kind", [("below_minus_one", "holds expert id"), ("at_num_experts", "holds expert id"),
                                       ("duplicate", "lists expert")])
def test_bad_routing_found_by_the_op_fails_on_both_group_shapes(result, case, kind):
    """Without validate_routing the op itself finds bad routing and fails the call (the context is then unusable)
    on a flat group and on a ("node", "gpu") group alike, with the same message in the group's global numbers
    (rank 2, token 3); an id below -1 is not taken for padding on either."""
    got = result["kernel_routing"][case]
    assert got["flat"] == got["hier"], got
    assert got["flat"].startswith("topk_idx of rank 2, token 3, " + kind), got


def test_contexts_stay_usable_after_the_refusals(result):
    assert result["usable"] == {"flat": True, "hier": True}
