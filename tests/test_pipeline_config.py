"""``lmfunc.config.pipeline``: layers per stage, stages per rank and each schedule's rules."""

import pytest

from lmfunc.config import ConfigError
from lmfunc.config.pipeline import SCHEDULES, check_microbatches, pipeline_split, split_layers


def test_an_even_split_keeps_model_wide_layer_indices():
    assert split_layers(8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert split_layers(3, 1) == ((0, 1, 2),)
    with pytest.raises(ConfigError, match=r"model.num_layers \(6\) is not divisible by the pipeline's stages .* = 4\)"):
        split_layers(6, 4)


def test_first_and_last_stage_overrides_split_the_rest_evenly():
    assert split_layers(10, 4, first_stage_layers=1, last_stage_layers=1) == ((0,), (1, 2, 3, 4), (5, 6, 7, 8), (9,))
    assert split_layers(7, 3, first_stage_layers=1) == ((0,), (1, 2, 3), (4, 5, 6))
    assert split_layers(6, 2, last_stage_layers=0) == ((0, 1, 2, 3, 4, 5), ())  # the head alone on the last stage
    with pytest.raises(ConfigError, match=r"leaves 7 layers for the other 2 stage\(s\)"):
        split_layers(9, 4, first_stage_layers=1, last_stage_layers=1)
    with pytest.raises(ConfigError, match=r"leaves 1 layers for the other 0 stage"):
        split_layers(4, 2, first_stage_layers=1, last_stage_layers=2)
    with pytest.raises(ConfigError, match=r"pp_first_stage_layers \(5\) must be between 0 and model.num_layers \(4\)"):
        split_layers(4, 2, first_stage_layers=5)


def test_loop_placement_interleaves_the_stages_over_ranks():
    split = pipeline_split(8, pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    assert split.num_stages == 4 and split.layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert split.stages_of_rank(0) == (0, 2) and split.stages_of_rank(1) == (1, 3)
    assert [split.rank_of_stage(s) for s in range(4)] == [0, 1, 0, 1]
    assert split.holds_embedding(0) and split.holds_head(3) and not split.holds_head(1)
    single = pipeline_split(4, pp=4, schedule="1f1b")
    assert [single.stages_of_rank(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_v_placement_puts_the_first_and_last_stage_on_rank_zero():
    split = pipeline_split(8, pp=2, schedule="zbv")
    assert split.stages_per_rank == 2 and split.stages_of_rank(0) == (0, 3) and split.stages_of_rank(1) == (1, 2)
    assert [split.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    with pytest.raises(ConfigError, match="runs 2 stage\\(s\\) per rank, but parallel.virtual_stages is 3"):
        pipeline_split(12, pp=2, schedule="zbv", virtual_stages=3)
    with pytest.raises(ConfigError, match="runs 1 stage\\(s\\) per rank, but parallel.virtual_stages is 2"):
        pipeline_split(8, pp=2, schedule="1f1b", virtual_stages=2)


def test_every_schedule_names_a_torch_schedule():
    from torch.distributed import pipelining

    assert all(hasattr(pipelining, cls) or hasattr(pipelining.schedules, cls) for cls, _, _ in SCHEDULES.values())
    with pytest.raises(ConfigError, match="parallel.pp_schedule must be one of gpipe, 1f1b"):
        pipeline_split(4, pp=2, schedule="2f2b")


@pytest.mark.parametrize("schedule, microbatches, ok", [
    ("gpipe", 1, True), ("1f1b", 3, False), ("1f1b", 4, True), ("interleaved-1f1b", 6, False),
    ("interleaved-1f1b", 8, True), ("zero-bubble", 2, False), ("zero-bubble", 4, True),
])
def test_microbatches_per_schedule(schedule, microbatches, ok):
    split = pipeline_split(8, pp=4, schedule=schedule)
    if ok:
        check_microbatches(schedule, split, microbatches)
    else:
        with pytest.raises(ConfigError, match=f"parallel.pp_schedule {schedule} needs"):
            check_microbatches(schedule, split, microbatches)


def test_train_config_validation_applies_the_pipeline_rules():
    from lmfunc.config import model_preset
    from lmfunc.config.parallel import ParallelConfig
    from lmfunc.config.train import DataConfig, RunConfig, TrainConfig

    def cfg(parallel, global_batch):
        return TrainConfig(model=model_preset("tiny", num_layers=4), data=DataConfig(seq_length=16), parallel=parallel,
                           run=RunConfig(micro_batch_size=2, global_batch_size=global_batch))

    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert cfg(interleaved, 8).validate(2, planning=True).run.global_batch_size == 8
    with pytest.raises(ConfigError, match=r"microbatches per step \(3\) to be a multiple of parallel.pp \(2\)"):
        cfg(interleaved, 6).validate(2, planning=True)
    with pytest.raises(ConfigError, match=r"model.num_layers \(4\) is not divisible by the pipeline's stages .* = 8\)"):
        cfg(ParallelConfig(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2), 16).validate(4, planning=True)
    with pytest.raises(ConfigError, match="set --parallel.pp to 2 or more"):
        cfg(ParallelConfig(pp_first_stage_layers=1), 8).validate(1, planning=True)
    assert cfg(ParallelConfig(pp=2), 8).validate(2).parallel.pp == 2
    assert cfg(ParallelConfig(pp=2, dp_shard=2, tp=2), 16).validate(8).parallel.tp == 2
    ramp = TrainConfig(model=model_preset("tiny", num_layers=4), data=DataConfig(seq_length=16),
                       parallel=ParallelConfig(pp=2),
                       run=RunConfig(micro_batch_size=2, global_batch_size=8, train_iters=None, train_samples=100,
                                     rampup_batch_size=(4, 4, 40)))
    with pytest.raises(ConfigError, match=r"run.rampup_batch_size \(\(4, 4, 40\)\) with parallel.pp = 2: .* batch "
                                          "shapes are fixed per run"):
        ramp.validate(2)
    per_microbatch = cfg(ParallelConfig(pp=2), 8)
    per_microbatch = per_microbatch.replace(run=RunConfig(micro_batch_size=2, global_batch_size=8,
                                                          calculate_per_token_loss=False))
    with pytest.raises(ConfigError, match=r"run.calculate_per_token_loss off with parallel.pp = 2"):
        per_microbatch.validate(2)


def test_split_backward_schedules_refuse_tied_embeddings_with_mtp():
    from lmfunc.config.pipeline import check_schedule_model

    check_schedule_model("1f1b", tie_embeddings=True, mtp_num_layers=1, compiled=False)
    check_schedule_model("zbv", tie_embeddings=False, mtp_num_layers=1, compiled=False)
    check_schedule_model("zero-bubble", tie_embeddings=True, mtp_num_layers=0, compiled=False)
    check_schedule_model("zero-bubble", tie_embeddings=True, mtp_num_layers=1, compiled=True)
    for schedule in ("zero-bubble", "zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=f"parallel.pp_schedule {schedule} splits the backward.*"
                                              "mtp_num_layers = 1.*--model.no-tie-embeddings"):
            check_schedule_model(schedule, tie_embeddings=True, mtp_num_layers=1, compiled=False)
