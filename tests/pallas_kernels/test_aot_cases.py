"""The kernel compile matrix covers what issue 19 asks of it: every kernel, weight format and
attention dimension (checked here, without compiling: the compiles are `test_tpu_aot.py`, in
the TPU environment)."""

from __future__ import annotations

import pytest

from pallas_kernels.aot_cases import (
    ATTENTION_CASES,
    MATMUL_CASES,
    MATRIX,
    MOE_CASES,
    AttentionCase,
)
from pallas_kernels.quant_matmul import registered_formats, tuning
from pallas_kernels.quant_matmul.kernel import MAX_INT4_BLOCK_K

KERNELS = {"ragged_paged_attention", "quantized_matmul", "moe_grouped_matmul"}


def test_every_kernel_is_in_the_matrix():
    assert {case.kernel for case in MATRIX} == KERNELS


def test_case_names_are_unique_per_kernel():
    names = [(case.kernel, case.name) for case in MATRIX]
    assert len(names) == len(set(names))


def _batch(case: AttentionCase) -> str:
    return "decode" if case.num_tokens == case.max_seqs else "mixed"


# Each dimension of ragged paged attention and the values the matrix must hold.
ATTENTION_DIMENSIONS = {
    "batch": (_batch, {"decode", "mixed"}),
    "kv dtype": (lambda case: case.int8_kv, {False, True}),
    "sliding window": (lambda case: case.sliding_window is not None, {False, True}),
    "soft-cap": (lambda case: case.soft_cap is not None, {False, True}),
    "gqa ratio": (lambda case: case.group, {1, 4, 8}),
    "head dim": (lambda case: case.head_dim, {64, 128, 256}),
    "page size": (lambda case: case.page_size, {16, 32, 64, 128}),
}


@pytest.mark.parametrize("dimension", sorted(ATTENTION_DIMENSIONS))
def test_attention_matrix_holds_every_value_in_bf16_and_int8(dimension):
    value_of, wanted = ATTENTION_DIMENSIONS[dimension]
    for int8 in (False, True):
        cases = [case for case in ATTENTION_CASES if case.int8_kv == int8]
        if dimension == "kv dtype":
            cases = ATTENTION_CASES
        assert {value_of(case) for case in cases} >= wanted, (dimension, int8)


def test_matmul_matrix_holds_every_format_and_int4_layout():
    assert {case.weight_format for case in MATMUL_CASES} == set(registered_formats())
    layouts = {(case.group_size, case.symmetric, case.m) for case in MATMUL_CASES
               if case.weight_format == "int4"}
    groups = {group for group, _, _ in layouts}
    assert groups >= {32, 64, 128, 256}
    # Every group size with and without zero points, at decode (M = 1) and at M = 256.
    assert layouts == {(group, symmetric, m) for group in groups
                       for symmetric in (True, False) for m in (1, 256)}


def test_matmul_int4_cases_are_ones_the_kernel_takes():
    for case in MATMUL_CASES:
        if case.weight_format == "int4":
            _, _, block_k = tuning.default_block_sizes("int4", case.m, case.k, case.n,
                                                       case.group_size)
            assert case.k % case.group_size == 0 and block_k <= MAX_INT4_BLOCK_K, case


def test_moe_matrix_holds_float_and_int8_weights():
    assert {case.int8 for case in MOE_CASES} == {False, True}
