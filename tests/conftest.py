"""Shared test set-up, run before any test imports TensorFlow.

The CPU is split into two logical devices so that tf.distribute tests can run
MirroredStrategy with two replicas on a machine without GPUs; this has to
happen before TensorFlow initialises its devices. The quick subset,
`pytest -m "not slow"`, is chosen here (NOTE [ The quick subset ]).
"""

import fnmatch
import os
import pathlib
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every machine runs the suite with oneDNN on, as TensorFlow runs by itself on CPUs with
# AVX-512 VNNI or BF16, AVX-VNNI or AMX, where its CPU allocator keeps the statistics that
# measuring reads (NOTE [ Counting CPU memory ] in tfrecompute/startup.py); elsewhere it does
# neither unless told before its import. tests/check/test_cpu_allocator.py runs without it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from tfrecompute.startup import count_cpu_memory  # noqa: E402

count_cpu_memory()  # where oneDNN stays off all the same (TF_ENABLE_ONEDNN_OPTS=0 set by hand)


# Temporary files (saved models, checkpoints, weight files) go to memory where the
# machine has a tmpfs: on these VMs the disk at times stalls writes for minutes (I/O
# wait, no CPU), which held single persistence tests that long.
def _roomy_tmpfs(path: str = "/dev/shm", needed: int = 4 << 30) -> bool:
    if not (os.path.isdir(path) and os.access(path, os.W_OK)):
        return False
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize >= needed


if "TMPDIR" not in os.environ and _roomy_tmpfs():
    os.environ["TMPDIR"] = "/dev/shm"
    tempfile.tempdir = None  # read TMPDIR again

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def collect_garbage():
    """Collects garbage after the test (`pytestmark = pytest.mark.usefixtures(...)`).

    Tests that train many models under `MirroredStrategy` leave much garbage behind,
    collected here in small sweeps. What held a late sweep for minutes was tf.data
    iterators of interrupted fits, each freed only when a sleeping thread wakes:
    tests/rewrite/test_persistence.py frees them right after the interruption instead
    (NOTE [ An interrupted fit's input pipeline ] there) and no longer uses this.
    """
    yield
    gc.collect()


# NOTE [ The quick subset ]
# `python -m pytest -m "not slow"` runs every test not marked slow: those marked in
# their file (`@pytest.mark.slow`, `pytestmark`), and those listed in `_SLOW` below.
# The list was measured: `python -m pytest -q -p no:cacheprovider --durations=0 -n 2
# --dist loadfile` (the whole suite: 70 min on 2 cores shared with other work, load
# average 3 to 7), then each test's setup + call + teardown time summed; the cheapest
# tests were kept up to 420 s of that, plus the cheapest test of each file that takes
# 15 s or less, two tests of tests/rewrite/test_persistence.py (saving), and every test
# directory keeps some. The rest is listed here. The quick subset then ran in 4 min
# 50 s (1232 of 1712 tests, one process, load average 4). Measured again from a full
# run's durations (46 min, nothing beside it): the subset's most expensive tests were
# listed, each file keeping its cheapest, down to 417 s of them; it ran in 5 min 52 s
# (1294 of 1789 tests, one process).
# A line is a file (all its tests), `file::test` (every parametrization) or
# `file::test[id]`; `*` in an id stands for any text. Measure again the same way when
# the subset drifts past about 6 minutes; a test added later is quick until listed.
_SLOW = """
benchmarks/test_benchmark_any_model.py
benchmarks/test_benchmark_depth_scaling.py::test_smoke_run_writes_results
benchmarks/test_benchmark_held_out.py::test_smoke_run_measures_each_plan_in_its_own_process
benchmarks/test_benchmark_selective.py
check/test_calibrate.py::test_a_subclassed_model_is_calibrated_through_a_model_that_calls_it
check/test_calibrate.py::test_calibrating_leaves_the_model_and_its_training_as_they_were
check/test_cpu_allocator.py::test_a_variable_set_after_tensorflow_started_is_named_in_the_error
check/test_cpu_allocator.py::test_a_variable_set_to_false_is_named_in_the_error
check/test_cpu_allocator.py::test_count_cpu_memory_after_importing_keras_lets_every_measurement_run
check/test_cpu_allocator.py::test_count_cpu_memory_after_tensorflow_started_raises_at_once
check/test_cpu_allocator.py::test_count_cpu_memory_leaves_a_process_with_onednn_as_it_is
check/test_cpu_allocator.py::test_measuring_without_statistics_says_how_to_have_them
check/test_cpu_allocator.py::test_the_command_line_counts_cpu_memory_itself
check/test_cpu_allocator.py::test_the_two_counting_allocators_differ_on_buffers_under_256_kib
check/test_max_batch_progress.py::test_a_search_that_reaches_its_limit_says_so_and_shows_each_probe
check/test_max_batch_progress.py::test_progress_false_is_quiet_and_a_function_gets_each_probe
check/test_measure_step.py::test_block_with_only_integer_inputs_still_saves_memory
check/test_measure_step.py::test_sqrt_blocks_at_most_halve_step_memory
check/test_precision.py::test_bfloat16_checkpoints_halve_block_memory
check/test_replay.py::test_a_plan_replayed_from_a_calibration_follows_its_traced_step
check/test_trace_step.py::test_trace_sees_recompute_keep_fewer_activations
check/test_verified_plan.py::test_a_verified_plan_measures_within_its_budget_and_uses_most_of_it
check/test_verified_plan.py::test_a_verified_plan_replaces_calls_checkpointed_in_place_as_it_re_plans
check/test_verified_plan.py::test_a_verified_plan_with_a_policy_measures_its_selective_blocks
check/test_verified_plan.py::test_max_batch_size_applies_the_policy_states_its_probe_measured
check/test_verified_plan.py::test_max_batch_size_fails_when_not_even_the_first_batch_fits
check/test_verified_plan.py::test_max_batch_size_finds_the_largest_measured_fit_in_fresh_processes
check/test_verified_plan.py::test_max_batch_size_with_optimal_beats_storing_everything
check/test_verified_plan.py::test_recompute_verify_returns_the_verified_model
cli/test_budget_share_and_limits.py::test_max_batch_says_when_it_stopped_at_its_limit
cli/test_command.py::test_a_command_prints_no_tensorflow_start_up_logs
cli/test_command.py::test_dim_fixes_a_backbones_unknown_dimensions
cli/test_command.py::test_help_and_usage_errors_answer_before_tensorflow_is_imported
cli/test_command_measured.py::test_max_batch_draws_a_bar_per_batch_size_and_fails_when_none_fits
cli/test_command_measured.py::test_plan_verify_prints_the_measured_step_within_the_budget
costs/test_loop_memory.py::test_a_stacked_lstm_step_is_predicted_within_15_percent
costs/test_measured.py::test_a_grouped_conv_under_xla_is_measured_and_predicted_within_20_percent
costs/test_optimizer.py::test_a_steps_update_peak_is_predicted[adamw]
costs/test_profile.py::test_the_recompute_copies_its_input
costs/test_quantized.py
layers/test_attention_policy.py::test_a_block_recomputes_only_the_core_exactly
layers/test_attention_policy.py::test_a_block_without_attention_warns
layers/test_attention_policy.py::test_a_budget_mixes_attention_cores_and_full_blocks
layers/test_attention_policy.py::test_a_model_without_attention_is_refused
layers/test_attention_policy.py::test_attention_computed_inline_trains_like_the_original[bloom-function]
layers/test_attention_policy.py::test_attention_computed_inline_trains_like_the_original[t5-eager]
layers/test_attention_policy.py::test_attention_computed_inline_trains_like_the_original[t5-function]
layers/test_attention_policy.py::test_fit_follows_the_plain_model
layers/test_attention_policy.py::test_fit_follows_the_plain_model_under_mirrored_strategy
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[bert-eager]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[bert-function]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[gemma-eager]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[gemma-function]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[gpt2-eager]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[gpt2-function]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[llama-function]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[vit-eager]
layers/test_attention_policy.py::test_keras_hub_models_train_like_the_original[vit-function]
layers/test_attention_policy.py::test_profile_prices_the_attention_state
layers/test_attention_policy.py::test_saves_and_exchanges_weights_like_the_plain_model
layers/test_attention_policy.py::test_the_backward_runs_no_projection_again
layers/test_block.py::test_model_fit_trains_exactly_like_unwrapped[True]
layers/test_block.py::test_variable_updates_in_the_same_step_do_not_reach_the_recompute
layers/test_block_exactness.py::test_an_explicitly_watched_frozen_variable_gets_its_gradient[False-function]
layers/test_block_exactness.py::test_model_fit_with_adamw_leaves_weights_without_gradient_in_place
layers/test_block_exactness.py::test_model_fit_with_adamw_trains_a_captured_gate_like_unwrapped
layers/test_block_exactness.py::test_retraced_steps_keep_no_tensors_alive
layers/test_block_nesting_masks_rnn.py::test_embedding_and_lstm_inside_a_block_produce_and_consume_the_mask[function]
layers/test_block_nesting_masks_rnn.py::test_mask_from_an_embedding_outside_reaches_lstm_and_gru_inside[function]
layers/test_block_nesting_masks_rnn.py::test_recurrent_layers_match_unwrapped[bidirectional_lstm-function]
layers/test_block_nesting_masks_rnn.py::test_recurrent_layers_match_unwrapped[gru_simple_rnn-function]
layers/test_block_nesting_masks_rnn.py::test_recurrent_layers_match_unwrapped[lstm_with_dropouts-function]
layers/test_block_peer_cases.py::test_keras_remat_basic_call
layers/test_block_peer_cases.py::test_tf_recompute_grad_with_nested_function_and_while_loop[function]
layers/test_block_peer_cases.py::test_torch_checkpoint_rng[function]
layers/test_block_peer_cases.py::test_torch_checkpointing_one_block_called_many_times[function]
layers/test_block_peer_cases.py::test_torch_checkpointing_without_reentrant_input_requires_grad[True-function]
layers/test_block_peer_cases.py::test_torch_custom_function_and_tf_custom_gradient_inside_a_checkpoint[function]
layers/test_block_policy.py::test_a_dots_step_keeps_its_products_and_no_more[xla]
layers/test_block_policy.py::test_dots_under_xla_trains_as_unwrapped[attention]
layers/test_block_policy.py::test_mirrored_fit_under_dots_matches_unwrapped
layers/test_block_xla_export_higher_order.py::test_functional_block_with_dropout_and_batchnorm_trains_alike_under_xla
layers/test_checkpoint_function.py::test_a_decorated_method_saves_like_the_plain_method
layers/test_checkpoint_function.py::test_a_decorated_method_trains_like_the_plain_method
layers/test_checkpoint_function.py::test_a_loss_with_no_layer_to_hold_it_fails_loudly
layers/test_checkpoint_function.py::test_bad_arguments_are_named
layers/test_checkpoint_function.py::test_captured_variables_get_their_gradients_and_unused_ones_none
layers/test_checkpoint_function.py::test_dropout_and_batch_norm_in_a_closure
layers/test_checkpoint_function.py::test_mirrored_strategy_trains_like_the_plain_method
layers/test_checkpoint_function.py::test_reaches_the_state_of_what_it_calls
layers/test_checkpoint_function.py::test_runs_plainly_without_a_tape_and_in_inference
layers/test_checkpoint_function.py::test_state_it_cannot_reach_fails_loudly
layers/test_checkpoint_function.py::test_xla
layers/test_distribute.py::test_mirrored_fit_matches_unwrapped[cpu-float32-bn]
layers/test_distribute.py::test_mirrored_fit_matches_unwrapped[cpu-float32-sync_bn]
layers/test_distribute.py::test_mirrored_fit_matches_unwrapped[cpu-mixed_bfloat16-bn]
layers/test_distribute.py::test_mirrored_fit_matches_unwrapped[cpu-mixed_bfloat16-sync_bn]
layers/test_multiworker.py
layers/test_property.py::test_random_models_rewritten_by_recompute_match_the_original
layers/test_property.py::test_random_models_with_random_blocks_match_the_original
rewrite/test_persistence.py::test_a_checkpoint_of_the_control_restores_into_the_model
rewrite/test_persistence.py::test_an_export_serves_what_the_control_serves
rewrite/test_persistence.py::test_backup_and_restore_every_2_batches_resumes_as_without_checkpointing
rewrite/test_persistence.py::test_backup_and_restore_per_epoch_resumes_as_without_checkpointing
rewrite/test_persistence.py::test_get_and_set_weights_keep_the_order_both_ways
rewrite/test_persistence.py::test_model_checkpoint_writes_files_that_load
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_every_variable_of_the_model
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[dots_block-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[functional_blocks-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[functional_blocks-plain]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[functional_recompute-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[functional_recompute-plain]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[sequential_blocks-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[sequential_blocks-plain]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[sequential_recompute-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[sequential_recompute-plain]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[subclassed_recompute-mirrored]
rewrite/test_persistence.py::test_tf_train_checkpoint_restores_the_model_and_its_optimizer[subclassed_recompute-plain]
rewrite/test_persistence.py::test_the_keras_file_loads_and_training_resumes_as_without_checkpointing
rewrite/test_persistence.py::test_upstream_a_list_of_layers_is_not_in_a_tf_checkpoint
rewrite/test_persistence.py::test_upstream_seed_states_are_not_saved
rewrite/test_persistence.py::test_weights_files_round_trip[functional_blocks]
rewrite/test_persistence.py::test_weights_files_round_trip[functional_recompute]
rewrite/test_persistence.py::test_weights_files_round_trip[sequential_blocks]
rewrite/test_persistence.py::test_weights_files_round_trip[sequential_recompute]
rewrite/test_persistence.py::test_weights_files_round_trip[subclassed_recompute]
rewrite/test_persistence.py::test_weights_move_between_the_model_and_its_control_both_ways
rewrite/test_persistence_keras_hub.py
strategies/test_optimal.py::test_equals_brute_force
strategies/test_optimal.py::test_equals_brute_force_up_to_twelve_layers[3-12]
strategies/test_strategies.py::test_sqrt_homogeneous_bound
test_docs.py::test_blocks_run_as_pasted
test_docs.py::test_docs_site_builds_strict
test_examples.py::test_bert_finetune
test_examples.py::test_functional_rewrite
test_examples.py::test_lora_finetune
test_examples.py::test_mirrored_strategy_example
test_examples.py::test_quickstart
test_layout.py::test_functions_stay_short
test_package.py::test_import_is_lazy_and_the_tensorflow_parts_load_on_first_use
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[bert]
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[gpt2]
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[loop_transformer]
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[nested_backbone]
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[towers]
whole_model/test_any_model.py::test_a_checkpointed_model_trains_like_the_original[vit]
whole_model/test_any_model.py::test_a_layer_in_two_blocks_saves_and_loads
whole_model/test_any_model.py::test_a_model_that_holds_blocks_is_planned_with_their_recompute
whole_model/test_any_model.py::test_a_tied_embedding_trains_and_saves
whole_model/test_any_model.py::test_fit_runs_and_the_model_round_trips
whole_model/test_any_model.py::test_llama_round_trips_although_its_layer_config_cannot
whole_model/test_any_model.py::test_mixed_precision_keeps_each_decoder_layer_a_link
whole_model/test_any_model.py::test_vit_round_trips_although_its_embedding_config_cannot
whole_model/test_any_model.py::test_weightless_preprocessing_is_never_put_in_a_block
whole_model/test_any_model.py::test_where_makes_each_selected_call_a_block[class]
whole_model/test_distribute_recompute.py::test_a_functional_model_checkpointed_in_the_scope_trains_like_the_control
whole_model/test_distribute_recompute.py::test_max_batch_size_in_the_scope
whole_model/test_distribute_recompute.py::test_other_kinds_checkpointed_in_the_scope_train_like_the_control
whole_model/test_entry_points.py::test_dir_of_a_model_is_the_same_after_recompute
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[bert_classifier-lora_first-eager]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[bert_classifier-lora_first-function]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[bert_classifier-recompute_first-eager]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[bert_classifier-recompute_first-function]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[gemma_causal_lm-lora_first-eager]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[gemma_causal_lm-lora_first-function]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[gemma_causal_lm-recompute_first-eager]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[gemma_causal_lm-recompute_first-function]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[llama-lora_first-function]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[llama-recompute_first-eager]
whole_model/test_lora.py::test_adapter_gradients_equal_the_control[llama-recompute_first-function]
whole_model/test_lora.py::test_fit_moves_the_adapters_as_the_control_and_nothing_else
whole_model/test_lora.py::test_lora_first_then_recompute_lowers_the_measured_step
whole_model/test_lora.py::test_under_a_mixed_policy_trains_as_the_control
whole_model/test_recompute.py::test_keras_masks_cross_the_rewrite
whole_model/test_recompute.py::test_keras_ops_in_a_functional_model[function]
whole_model/test_recompute.py::test_sequential_sqrt_rewrite_matches_original[function]
whole_model/test_recompute_policy.py::test_a_budget_on_a_model_with_attention_weighs_the_attention_and_dots_states
whole_model/test_recompute_policy.py::test_a_functional_encoder_rewrite_under_dots_trains_as_the_original[function]
whole_model/test_recompute_policy.py::test_a_keras_hub_bert_under_dots_trains_as_the_original
whole_model/test_recompute_policy.py::test_a_plan_over_four_states_gives_each_block_its_policy[function]
whole_model/test_recompute_policy.py::test_recompute_applies_the_plans_selective_segments
whole_model/test_recompute_policy.py::test_the_command_line_plans_with_a_policy
"""
_ROOT = pathlib.Path(__file__).resolve().parent


def _slow_patterns() -> tuple[set[str], list[str]]:
    """The files of `_SLOW` whose every test is slow, and the patterns of single tests."""
    files, tests = set(), []
    for line in filter(None, _SLOW.splitlines()):
        if "::" in line:
            # `[` opens a character class in fnmatch: match it literally.
            tests.append(line.replace("[", "[[]"))
        else:
            files.add(line)
    return files, tests


def pytest_collection_modifyitems(config, items):
    """Marks the tests `_SLOW` lists slow (NOTE [ The quick subset ])."""
    files, tests = _slow_patterns()
    for item in items:
        try:
            path = item.path.resolve().relative_to(_ROOT).as_posix()
        except ValueError:  # a test outside this folder
            continue
        name = f"{path}::{item.nodeid.split('::', 1)[-1]}"
        function = name.split("[", 1)[0]
        if path in files or any(
            fnmatch.fnmatchcase(name, test) or fnmatch.fnmatchcase(function, test) for test in tests
        ):
            item.add_marker(pytest.mark.slow)
