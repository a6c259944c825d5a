"""Private torch names of ``torch.distributed``: process groups, DTensor's caches, the fake backend
and pipelining internals that the dry run and the compiled collectives need; with their version
branches."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from lmfunc.compiler.torch_compat import Private, lazy_names

ENTRIES: dict[str, Private] = {
    "resolve_process_group": Private("torch.distributed.distributed_c10d:_resolve_process_group", "a traced "
                                     "collective's group from its name (is it gloo?)", "none"),
    "c10d_world": Private("torch.distributed.distributed_c10d:_world", "the dry run names every process group "
                          "the step uses by its mesh dims", "none"),
    "gen_transform_infos": Private("torch.distributed.tensor._redistribute:_gen_transform_infos", "DTensor's "
                                   "redistribute plans cached by mesh equality, cleared between fake worlds",
                                   "none"),
    "clear_python_sharding_prop_cache": Private(
        "torch.distributed.tensor.debug:_clear_python_sharding_prop_cache", "the same for sharding decisions",
        "none"),
    "clear_fast_path_sharding_prop_cache": Private(
        "torch.distributed.tensor.debug:_clear_fast_path_sharding_prop_cache", "the same, C++ fast path", "none"),
    "fake_pg": Private("torch.testing._internal.distributed.fake_pg", "registers the 'fake' process-group "
                       "backend the dry run traces on", "none (torch.distributed has no public fake backend)"),
    "InferenceMode": Private("torch.distributed.pipelining._utils:InferenceMode", "a pipeline stage's shapes "
                             "fixed from its metadata (the dry run, 2.13+)", "none", since=(2, 13)),
    "make_receive_buffer": Private("torch.distributed.pipelining._utils:_make_tensor_from_meta", "the stages' "
                                   "receive buffers counted by the dry run (each is made by it)", "none",
                                   since=(2, 13)),
    "PipelineSchedule": Private("torch.distributed.pipelining.schedules:_PipelineSchedule", "the schedules' "
                                "start-up shape vote (2.11 to 2.14: its _warmup_p2p)", "none"),
}

__getattr__ = lazy_names(__name__, ENTRIES)


def _static_vote(self, stages, has_backward, p2p_done) -> None:
    """The start-up vote's outcome where every stage was given its shapes: static inference."""
    mode = __getattr__("InferenceMode")
    for stage in stages:
        if mode.needs_dynamic(stage._user_meta, has_backward):
            raise RuntimeError(f"pipeline stage {stage.stage_index} was built without its shapes: the dry run needs them")
        stage._inference_mode = mode.STATIC


@contextlib.contextmanager
def pipeline_shapes_without_vote() -> Iterator[None]:
    """While inside, pipeline schedules on a fake process group take their stages' given shapes
    without the start-up vote (a collective whose result the fake backend never fills). torch 2.11
    to 2.14 vote in ``_PipelineSchedule._warmup_p2p``, which is replaced here by its outcome; 2.15
    skips the vote on the fake backend itself."""
    from unittest import mock

    schedule = __getattr__("PipelineSchedule")
    if not hasattr(schedule, "_warmup_p2p"):
        yield
        return
    with mock.patch.object(schedule, "_warmup_p2p", _static_vote):
        yield


@contextlib.contextmanager
def receive_buffers_made_inside(wrap: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """While inside, each receive buffer a pipeline stage allocates is made inside ``wrap()``: the
    ``make_receive_buffer`` calls of the module that allocates them (2.15: ``_recv_buffers``;
    before: ``stage``) go through ``wrap``."""
    import importlib
    from unittest import mock

    try:
        allocating = importlib.import_module("torch.distributed.pipelining._recv_buffers")
    except ImportError:
        allocating = importlib.import_module("torch.distributed.pipelining.stage")
    make_buffer = __getattr__("make_receive_buffer")

    def receive_buffer(*args: Any, **kwargs: Any) -> Any:
        with wrap():
            return make_buffer(*args, **kwargs)

    with mock.patch.object(allocating, "_make_tensor_from_meta", receive_buffer):
        yield
