"""Private torch names for Inductor: custom graph passes and the collectives they match, settings,
caches and the CPU kernels' C++ builds; with the version branches of Inductor's options."""

from __future__ import annotations

from typing import Any, Callable

from lmfunc.compiler.torch_compat import Private, lazy_names, torch_at_least

_PASS = "lmfunc's graph passes (recompute, slice copies, reversed scans, accumulation order, buckets)"
_BUCKETING = "the collective-bucketing pass finds, merges and rewrites functional collectives"

ENTRIES: dict[str, Private] = {
    "inductor": Private("torch._inductor", "torch._inductor.compile: Inductor on a graph Dynamo captured, "
                        "after Dynamo's state is freed", "none (torch.compile does both at once)"),
    "inductor_config": Private("torch._inductor.config", "the passes and settings of each compile, held only "
                               "while compiling", "torch.compile(options=...) takes only some of them"),
    "cache_dir": Private("torch._inductor.runtime.cache_dir_utils:cache_dir", "per-rank compile caches, the "
                         "compile lock, the ISA record and the precompiled step live in Inductor's cache "
                         "directory", "TORCHINDUCTOR_CACHE_DIR alone"),
    "CustomGraphPass": Private("torch._inductor.custom_graph_pass:CustomGraphPass", _PASS + ", with a cache key",
                               "none"),
    "get_hash_for_files": Private("torch._inductor.custom_graph_pass:get_hash_for_files", _PASS + ": the source "
                                  "files in the cache key", "none"),
    "is_all_gather_into_tensor": Private("torch._inductor.fx_passes.bucketing:is_all_gather_into_tensor",
                                         _BUCKETING, "none"),
    "is_all_reduce_tensor": Private("torch._inductor.fx_passes.bucketing:is_all_reduce_tensor", _BUCKETING, "none"),
    "is_reduce_scatter_tensor": Private("torch._inductor.fx_passes.bucketing:is_reduce_scatter_tensor", _BUCKETING,
                                        "none"),
    "is_all_to_all_tensor": Private("torch._inductor.fx_passes.bucketing:is_all_to_all_tensor", _BUCKETING, "none"),
    "is_wait_tensor": Private("torch._inductor.fx_passes.bucketing:is_wait_tensor", _BUCKETING, "none"),
    "merge_all_gather_bucket": Private("torch._inductor.fx_passes.bucketing:merge_all_gather_bucket", _BUCKETING,
                                       "Inductor's own bucketing (bucket_all_gathers_fx), which buckets by "
                                       "size alone"),
    "merge_all_reduce_bucket": Private("torch._inductor.fx_passes.bucketing:merge_all_reduce_bucket", _BUCKETING,
                                       "bucket_all_reduces_fx"),
    "merge_reduce_scatter_bucket": Private("torch._inductor.fx_passes.bucketing:merge_reduce_scatter_bucket",
                                           _BUCKETING, "bucket_reduce_scatters_fx"),
    "process_collective_bucket": Private("torch._inductor.fx_passes.bucketing:process_collective_bucket",
                                         "a gloo reduce-scatter rewritten as an all-to-all", "none"),
    "preserve_node_ordering": Private("torch._inductor.fx_passes.control_dependencies:preserve_node_ordering",
                                      "keeps a pass's order of collectives and sums through Inductor's "
                                      "scheduler", "none"),
    "control_deps": Private("torch._inductor.fx_passes.control_dependencies:control_deps", "the dry run sees "
                            "through those ordering nodes", "none"),
    "stable_topological_sort": Private("torch._inductor.pattern_matcher:stable_topological_sort", "a pass's "
                                       "graph put back in order", "none"),
    "CallFunctionVarArgs": Private("torch._inductor.pattern_matcher:CallFunctionVarArgs", "the reversed-scan "
                                   "lowering matches its pattern", "none"),
    "Match": Private("torch._inductor.pattern_matcher:Match", "the reversed-scan lowering", "none"),
    "PatternMatcherPass": Private("torch._inductor.pattern_matcher:PatternMatcherPass", "the reversed-scan "
                                  "lowering", "none"),
    "register_graph_pattern": Private("torch._inductor.pattern_matcher:register_graph_pattern", "the "
                                      "reversed-scan lowering", "none"),
    "OrderedSet": Private("torch.utils._ordered_set:OrderedSet", "the set type Inductor's APIs take and return",
                          "none"),
    "scheduler": Private("torch._inductor.scheduler", "in-place buffer reuse despite input writes "
                         "(inplace_reuse)", "none"),
    "WeakDep": Private("torch._inductor.dependencies:WeakDep", "in-place reuse: a dependency that only orders",
                       "none"),
    "cpp_builder": Private("torch._inductor.cpp_builder", "GCC flags that keep the CPU kernels correct "
                           "(cpp_flags) and the compiler's version in the ISA record", "none"),
    "cpu_vec_isa": Private("torch._inductor.cpu_vec_isa", "Inductor's vector-ISA check run beside the trace "
                           "and recorded (isa_probe)", "none"),
    "AsyncCompile": Private("torch._inductor.async_compile:AsyncCompile", "the CPU kernels built in a few "
                            "batches (kernel_batches)", "none"),
    "get_compile_threads": Private("torch._inductor.async_compile:get_compile_threads", "kernel batches: how "
                                   "many builds run at once", "none"),
    "kernel_code_log": Private("torch._inductor.async_compile:kernel_code_log", "kernel batches log their "
                               "source like Inductor", "none"),
    "CppPythonBindingsCodeCache": Private("torch._inductor.codecache:CppPythonBindingsCodeCache", "kernel "
                                          "batches build through Inductor's code cache", "none"),
    "clear_on_fresh_cache": Private("torch._inductor.utils:clear_on_fresh_cache", "kernel batches' cache cleared "
                                    "with Inductor's", "none"),
    "FxGraphCachePickler": Private("torch._inductor.codecache:FxGraphCachePickler", "a DeviceMesh's cache key "
                                   "the same in every process (mesh_cache_keys)", "none"),
    "codecache_ident": Private("torch._inductor.codecache:_ident", "that cache key's reduction", "none"),
}

__getattr__ = lazy_names(__name__, ENTRIES)

ISA_PROBE_MODULES = (
    "torch._inductor.cpu_vec_isa", "torch._inductor.codecache", "torch._inductor.cpp_builder",
    "torch.utils._filelock", "torch.utils.cpp_extension", "torch._inductor.runtime.cache_dir_utils",
)
"""Every module Inductor's vector-ISA check imports on its way, imported before the probe's thread
starts (``torch.utils.cpp_extension`` pulls in setuptools, which patches distutils as it loads)."""

INDUCTOR_RECORDS_ISA_CHECKS = torch_at_least(2, 15)
"""Whether Inductor records a vector-ISA check's library that loaded (a ``.load_ok`` file beside
it, 2.15+), so a later process loads none again: lmfunc's own record (``isa_probe``) is then
redundant."""


def post_grad_pre_passes(passes: list) -> Any:
    """Inductor's ``post_grad_custom_pre_pass`` option for ``passes`` run in order: the list
    itself (2.13+), one ``CustomGraphPass`` that runs them all before (2.11 and 2.12 take one)."""
    if torch_at_least(2, 13):
        return passes
    base = __getattr__("CustomGraphPass")

    class Chained(base):
        def __call__(self, graph):
            for graph_pass in passes:
                graph_pass(graph)

        def uuid(self):
            return b"".join(graph_pass.uuid() for graph_pass in passes)

    return Chained()


def no_line_tables() -> dict[str, Any]:
    """The Inductor option that builds CPU kernels without line tables (2.13+); empty before
    (2.11's Inductor builds with them: slower builds, the same kernels)."""
    return {"aot_inductor.enable_line_tables": False} if torch_at_least(2, 13) else {}


def resolve_group_name(group: Any) -> Any:
    """A collective node's group argument as a group name (2.13+ may pass a group object; 2.11
    passes the name)."""
    try:
        from torch._inductor.fx_passes.bucketing import _resolve_group_name
    except ImportError:
        return group
    return _resolve_group_name(group)

