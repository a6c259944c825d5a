"""The compat tier: the tests ``.ci/run`` also runs on the oldest and the newest supported torch
(2.11 and 2.15; the README's tiers run on 2.13). ``tests/conftest.py`` marks each test whose node id
starts with an entry here ``compat``.

- Every compiled-step core test runs on all three torches: the non-slow entries stay in the
  README's default tier too.
- The slow multi-rank compiled entries (pipeline, cp, ep) need torch 2.13+ (a compiled step on a
  DTensor mesh) and run on 2.15 only: the 2.13 slow tier leaves them to this tier
  (``-m "slow and not compat"``), so each runs on one torch, not two.
"""

COMPAT_TESTS = (
    # torch_compat itself, value_and_grad compiled, the refusals of an older torch
    "tests/test_torch_compat.py::",
    "tests/test_grad.py::",
    "tests/test_torch_support.py::",
    # the compiled step against eager, and the compile's caches and settings
    "tests/test_step.py::test_compiled_step_equals_eager_and_is_one_graph",
    "tests/test_compiling.py::test_a_restarted_process_loads_the_compiled_step_from_inductors_cache",
    "tests/test_compiling.py::test_tracing_settings_hold_only_on_calls_that_trace",
    "tests/test_compiling.py::test_importing_lmfunc_and_running_a_compiled_step_change_no_torch_setting",
    "tests/test_moe.py::test_both_expert_paths_compile_to_one_graph_with_the_eager_values",
    # the megatron-core oracle and the HF parity
    "tests/test_megatron_oracles.py::",
    "tests/test_megatron.py::test_megatrons_model_on_mapped_weights_gives_lmfuncs_losses_and_gradients",
    "tests/test_hf.py::test_export_to_hf_gives_the_same_logits_and_imports_back",
    # multi-rank compiled steps (slow; 2.15 only)
    "tests/test_train_pipeline.py::test_pp2_with_compiled_stages_and_update_trains_like_one_process",
    "tests/test_context_parallel.py::test_a_sequence_split_over_cp_trains_like_one_process[1 2 1 0-0-1-1-selective---moe --mla]",
    "tests/test_parallel.py::test_moe_and_mla_invariance[dp_shard=2,ep=2--moe--mla--compile]",
)


def in_compat_tier(nodeid: str) -> bool:
    """Whether the test ``nodeid`` is in the compat tier."""
    return nodeid.startswith(COMPAT_TESTS)
