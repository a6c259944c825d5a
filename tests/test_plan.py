"""``lmfunc.plan``: Megatron's theoretical numbers to the byte and FLOP, lmfunc's per-rank prediction,
and ``python -m lmfunc.plan``."""

import dataclasses

import pytest

from lmfunc.config import ConfigError, ModelConfig
from lmfunc.config.parallel import ParallelConfig
from lmfunc.config.train import DataConfig, RunConfig, TrainConfig
from lmfunc.parallel.sharding import local_shape
from lmfunc.plan import format_plan, make_plan
from lmfunc.plan.__main__ import main as plan_main
from lmfunc.plan.memory import layer_kept_bytes, local_params, predict_memory

# megatron.md section 7: preset "tiny" (L=2, h=64, a=4, LayerNorm, GeLU, tied, V=384, s=128, b=2, B=8).
WORKED = TrainConfig(
    model=ModelConfig(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, normalization="LayerNorm",
                      activation="gelu", max_position_embeddings=128),
    data=DataConfig(seq_length=128), run=RunConfig(micro_batch_size=2, global_batch_size=8),
)
WORKED_FLAGS = ["--model.vocab-size", "384", "--model.hidden-size", "64", "--model.num-layers", "2",
                "--model.num-attention-heads", "4", "--model.normalization", "LayerNorm", "--model.activation", "gelu",
                "--model.max-position-embeddings", "128", "--data.seq-length", "128", "--run.micro-batch-size", "2",
                "--run.global-batch-size", "8"]


def plan_of(cfg: TrainConfig, world_size: int = 1):
    return make_plan(cfg.validate(world_size, planning=True), world_size)


def test_megatrons_worked_example_to_the_byte_and_flop():
    meg = plan_of(WORKED).megatron
    assert meg.counts.total == 123_520
    assert meg.counts.most_loaded_shard == 123_520
    assert meg.weight_and_optimizer == 2_223_360
    assert not meg.sp_formula
    assert meg.activations == meg.activations_without_sp == pytest.approx(1_430_016, abs=1e-6)
    assert meg.activations_sp == 1_591_296
    assert meg.flops_per_iteration == 855_638_016
    assert meg.footprint_line() == ("Theoretical memory footprints: weight and optimizer=2.12 MB, "
                                    "activation=1.36 MB, total=3.48 MB")


def test_the_cli_prints_megatrons_numbers(capsys):
    plan_main(WORKED_FLAGS)
    out = capsys.readouterr().out
    for text in ("total 123,520", "2,223,360 B", "1,430,016 B", "1,591,296 B", "855,638,016 (835,584 per token)",
                 "weight and optimizer=2.12 MB, activation=1.36 MB, total=3.48 MB", "peak step memory"):
        assert text in out


def test_tensor_parallel_shard_and_the_distributed_optimizer():
    """tp 2 x dp_shard 2: the tp-split part (attention, MLP, embedding) halves, norms stay whole;
    the distributed optimizer's 6 + 12/dp bytes per parameter, which Megatron's footprint line
    shows for a run that shards its optimizer (dp_shard), not for DDP."""
    cfg = WORKED.replace(parallel=ParallelConfig(tp=2, dp_shard=2))
    meg = plan_of(cfg, 4).megatron
    assert meg.counts.tp_sharded_on_most_loaded == (2 * (16_384 + 32_768) + 24_576) / 2
    assert meg.counts.most_loaded_shard == 61_440 + 2 * 256 + 128
    assert meg.weight_and_optimizer == 62_080 * 18
    assert meg.weight_and_optimizer_distributed == 62_080 * (6 + 12 / 2)
    weights = 62_080 * (6 + 12 / 2) / 2**20
    assert f"weight and optimizer={weights:.2f} MB, activation={meg.activations / 2**20:.2f} MB" in meg.footprint_line()
    ddp = plan_of(WORKED.replace(parallel=ParallelConfig(tp=2, dp_replicate=2)), 4).megatron
    assert f"weight and optimizer={62_080 * 18 / 2**20:.2f} MB" in ddp.footprint_line()


def test_pipeline_parallel_is_planned_with_megatrons_formulas():
    """pp 2, 4 microbatches: half the layers plus the embedding on the first stage; the activations
    lose the output-layer term; trainable alone and beside dp_shard."""
    cfg = WORKED.replace(parallel=ParallelConfig(pp=2), run=RunConfig(micro_batch_size=2, global_batch_size=8))
    plan = plan_of(cfg, 2)
    meg = plan.megatron
    assert meg.counts.most_loaded_shard == 2 * 49_152 / 2 + 24_576 + (2 * 256 + 128) / 2
    assert meg.counts.other_shards == 2 * 49_152 / 2 + (2 * 256 + 128) / 2
    assert meg.activations == pytest.approx(1.05 * (557_056 * 2 + 8 * 128 * 2 * 2 + 128 * 2 * 64 * 2))
    assert plan.untrainable == [] and plan.unpredicted == [] and plan.lmfunc.chunks_in_flight == 2
    assert cfg.validate(2).parallel.pp == 2
    with_fsdp = cfg.replace(parallel=ParallelConfig(pp=2, dp_shard=2))
    plan = plan_of(with_fsdp, 4)
    assert plan.untrainable == [] and plan.unpredicted == []
    assert with_fsdp.validate(4).parallel.dp_shard == 2
    zbv = cfg.replace(model=dataclasses.replace(cfg.model, tie_embeddings=False, num_layers=4),
                      parallel=ParallelConfig(pp=2, pp_schedule="zbv"))
    plan = plan_of(zbv, 2)
    assert plan.lmfunc is None and plan.unpredicted == ["parallel.pp = 2 with parallel.pp_schedule zbv"]
    assert "lmfunc: trainable; its own memory prediction does not model this layout yet" in format_plan(plan)


@pytest.mark.parametrize("schedule, pp, virtual, microbatches, expected", [
    ("gpipe", 2, None, 8, [8, 8]),
    ("1f1b", 2, None, 8, [2, 1]),
    ("1f1b", 4, None, 8, [4, 3, 2, 1]),
    ("1f1b", 4, None, 2, [2, 2, 2, 1]),
    ("interleaved-1f1b", 2, 2, 4, [5, 3]),
    ("zero-bubble", 2, 2, 8, [4, 3]),
    ("zbv", 2, None, 8, [None, None]),
])
def test_chunks_in_flight_per_schedule(schedule, pp, virtual, microbatches, expected):
    """Stage-microbatches a rank holds at once; the pp 2 counts are those the pipeline benchmark
    measures from the order of torch's actions (``experiments.bench.pipeline``, docs/performance.md)."""
    from lmfunc.config.pipeline import pipeline_split
    from lmfunc.plan.pipeline_memory import chunks_in_flight

    split = pipeline_split(8, pp, schedule, virtual)
    assert [chunks_in_flight(schedule, split, microbatches, r) for r in range(pp)] == expected


def test_a_pipeline_ranks_prediction_counts_its_own_leaves_and_chunks():
    """pp 2 of the tiny model, tied: rank 0 holds the embedding and layer 0, rank 1 layer 1, the final
    norm and the embedding again (tied); their elements sum to the model's plus one embedding, and
    dp_shard 2 halves every leaf sharded along its hidden size. GPipe holds all 4 microbatches on
    each rank, 1F1B 2 on the first and 1 on the last, and the activations scale with them; each
    rank's stage holds one receive buffer per microbatch."""
    from lmfunc.plan.pipeline_memory import predict_pipeline_rank

    cfg = WORKED.replace(model=dataclasses.replace(WORKED.model, activation="swiglu", normalization="RMSNorm"),
                         parallel=ParallelConfig(pp=2))
    total = local_params(cfg.model, {})
    first, last = (predict_pipeline_rank(cfg, {"pp": 2}, r) for r in range(2))
    assert first.params + last.params == total + 384 * 64
    assert last.head > 0 and first.head == 0
    assert (first.chunks_in_flight, last.chunks_in_flight) == (2, 1)
    assert first.peak == (first.state + first.grads + first.compute_copies + first.activations + first.head
                          + first.receive_buffers)
    # torch's stages receive into a buffer per microbatch, kept: rank 0 its gradients, rank 1 its activations
    hidden = cfg.run.micro_batch_size * cfg.data.seq_length * cfg.model.hidden_size * 4
    microbatches = cfg.run.global_batch_size // cfg.run.micro_batch_size
    assert first.receive_buffers == last.receive_buffers == microbatches * hidden
    gpipe = cfg.replace(parallel=ParallelConfig(pp=2, pp_schedule="gpipe"))
    assert predict_pipeline_rank(gpipe, {"pp": 2}, 0).activations == 2 * first.activations
    sharded = predict_pipeline_rank(cfg, {"pp": 2, "dp_shard": 2}, 0)
    assert sharded.params == first.params // 2 and sharded.compute_copies == 4 * first.params


def test_moe_counts_and_flops():
    """4 experts of width 128, top-2 (hand-computed from Megatron's formulas): the routed MLP costs
    what the dense width-256 MLP costs per token, so the FLOPs equal the worked example's."""
    cfg = WORKED.replace(model=dataclasses.replace(WORKED.model, num_experts=4, moe_ffn_hidden_size=128,
                                                   moe_router_topk=2))
    meg = plan_of(cfg).megatron
    moe_layer = 16_384 + 2 * 64 * 128 * 4 + 256 + 64 * 4
    assert meg.counts.total == 2 * moe_layer + 128 + 24_576
    assert meg.counts.active == 2 * (16_384 + 2 * 64 * 128 * 2 + 256 + 64 * 4) + 128 + 24_576
    assert meg.flops_per_iteration == 855_638_016
    with pytest.raises(ConfigError, match=r"model\.activation = 'gelu' with MoE"):
        cfg.validate(1)
    swiglu = cfg.replace(model=dataclasses.replace(cfg.model, activation="swiglu"))
    assert plan_of(swiglu).unpredicted == [] and plan_of(swiglu).lmfunc is not None
    full = swiglu.replace(model=dataclasses.replace(swiglu.model, recompute_granularity="full"))
    assert plan_of(full).unpredicted == ["model.num_experts = 4 with full recompute"]
    swiglu.validate(1)
    swiglu.replace(parallel=ParallelConfig(dp_shard=2)).validate(2)
    for layout in (ParallelConfig(pp=2), ParallelConfig(cp=2), ParallelConfig(dp_shard=2, ep=2)):
        plan = plan_of(swiglu.replace(parallel=layout).validate(2), 2)
        assert plan.untrainable == [] and plan.lmfunc is not None, layout


def test_a_pipeline_stage_keeps_its_moe_layers_values():
    """pp 2, gpipe, 2 microbatches of 4 layers, the last two MoE layers: each chunk in flight keeps
    its stage's layers' values (MoE layers their experts', ``layer_kept_bytes(moe=True)``) and its
    boundary hidden states; the compute copy keeps the experts split over ep."""
    from lmfunc.plan.pipeline_memory import predict_pipeline_rank

    m = dataclasses.replace(WORKED.model, num_layers=4, activation="swiglu", num_experts=4, moe_ffn_hidden_size=128,
                            moe_router_topk=2, moe_layer_freq=(0, 0, 1, 1))
    cfg = WORKED.replace(model=m, parallel=ParallelConfig(pp=2, pp_schedule="gpipe"),
                         run=RunConfig(micro_batch_size=2, global_batch_size=4))
    dense, routed = layer_kept_bytes(cfg, 1, "none"), layer_kept_bytes(cfg, 1, "none", moe=True)
    assert routed != dense
    output = 2 * 128 * 64 * 4  # the first stage's output hidden states; the last stage's is the loss
    first, last = (predict_pipeline_rank(cfg, {"pp": 2}, rank) for rank in (0, 1))
    assert first.activations == 2 * (2 * dense + output) and last.activations == 2 * 2 * routed
    expert_parallel = predict_pipeline_rank(cfg, {"pp": 2, "dp_shard": 1, "ep": 2}, 1)
    experts = 2 * 3 * 4 * 64 * 128  # two layers' w_gate, w_up and w_out, [4, 64, 128] each
    assert expert_parallel.compute_copies == 4 * (last.params - experts // 2)


def test_moe_layers_keep_their_experts_values_in_place_of_the_mlps():
    """Per token: k x (2 h + 3 f_expert) compute values and 3 fp32 router values per expert, in
    place of the dense MLP's 3 f; a shared expert adds a dense MLP of its width (fp32 here)."""
    base = WORKED.validate(1)
    moe = base.replace(model=dataclasses.replace(base.model, activation="swiglu", num_experts=4, moe_router_topk=2,
                                                 moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32))
    h, dense_f, tokens = 64, moe.model.ffn_size, base.run.micro_batch_size * base.data.seq_length
    extra = layer_kept_bytes(moe, 1, "none", moe=True) - layer_kept_bytes(moe, 1, "none")
    assert extra == tokens * 4 * (2 * (2 * h + 3 * 48) + 3 * 4 + 3 * 32 - 3 * dense_f)
    dense_layers_only = predict_memory(moe.replace(model=dataclasses.replace(moe.model, num_experts=None)), {"dp_shard": 1})
    with_experts = predict_memory(moe, {"dp_shard": 1})
    assert with_experts.activations - dense_layers_only.activations == 2 * extra  # both layers are MoE layers


def test_mla_layers_keep_their_heads_latents_and_padded_values():
    """Per token: 2 a (d_nope + d_rope) + 3 a max(d_nope + d_rope, d_v) + 2 r_q + 1.5 r_kv values in place of
    the query/key/value terms (2 a d + 2 g d): the values padded to the query width for the CPU's
    fused kernel (``layers.fused_attention``), so no probabilities; MLA with recompute is not predicted."""
    base = WORKED.validate(1)
    mla = base.replace(model=dataclasses.replace(base.model, multi_latent_attention=True, q_lora_rank=24,
                                                 kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6))
    a, d, tokens = 4, 16, base.run.micro_batch_size * base.data.seq_length
    extra = layer_kept_bytes(mla, 1, "none") - layer_kept_bytes(base, 1, "none")
    assert extra == tokens * 4 * (2 * a * 12 + 3 * a * 12 + 2 * 24 + 1.5 * 16 - 2 * a * d - 2 * a * d)
    selective = mla.replace(model=dataclasses.replace(mla.model, recompute_granularity="selective"))
    assert plan_of(selective).unpredicted == ["model.multi_latent_attention with selective recompute"]


def test_mla_counts():
    cfg = WORKED.replace(model=dataclasses.replace(WORKED.model, multi_latent_attention=True, kv_lora_rank=32,
                                                   qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16))
    meg = plan_of(cfg).megatron
    attention = 64 * 4 * (16 + 8) + 32 * (64 + 4 * (16 + 16) + 2) + 64 * 8 + 4 * 16 * 64
    assert meg.counts.total == 2 * (attention + 32_768 + 256) + 128 + 24_576
    core = 6 * (4 * (16 + 8) / 2 + 4 * 16 / 2)
    linear = 6 * (64 * 4 * (16 + 8) + 32 * (64 + 4 * (16 + 16) + 1) + 64 * 8 + 4 * 16 * 64)
    assert meg.flops_per_iteration == 1024 * (393_216 + 2 * linear + 147_456) + 8 * 128**2 * 2 * core


def test_local_shapes_follow_the_sharding_rules():
    assert local_shape((384, 64), ("vocab", "embed"), {"tp": 2, "dp_shard": 2}) == (192, 32)
    assert local_shape((64,), ("embed",), {"tp": 2}) == (64,)
    assert local_shape((63, 5), ("embed", "mlp"), {"dp_shard": 2}) == (32, 5)  # DTensor's ceil split
    model = WORKED.model
    assert local_params(model, {"dp_shard": 1}) == 123_520
    assert local_params(model, {"dp_shard": 2}) == 123_520 / 2
    assert local_params(model, {"dp_shard": 2}, data_parallel_sharded=False) == 123_520


def test_lmfunc_prediction_by_layout_precision_and_recompute():
    base = WORKED.validate(1)
    single = predict_memory(base, {"dp_shard": 1})
    assert single.state == 12 * 123_520 and single.grads == 4 * 123_520 and single.compute_copies == 0
    fsdp = predict_memory(base, {"dp_shard": 2})
    # gathered for compute, two regions at a time: here the two layers (49,408 elements each), larger
    # than the embedding (24,576) and the head (the final norm's 128 and the tied embedding again)
    assert local_params(base.model, {"dp_shard": 1}, prefix="layers.0.") == 49_408
    assert fsdp.state == single.state / 2 and fsdp.compute_copies == 4 * 2 * 49_408
    # from the second microbatch on, the gradients accumulated over the first are held beside its values
    assert base.run.global_batch_size > base.run.micro_batch_size
    one_microbatch = base.replace(run=dataclasses.replace(base.run, global_batch_size=base.run.micro_batch_size))
    assert single.peak == predict_memory(one_microbatch, {"dp_shard": 1}).peak + single.grads
    bf16 = predict_memory(base.replace(precision=dataclasses.replace(base.precision, compute_dtype="bf16")),
                          {"dp_shard": 1})
    assert bf16.compute_copies == 2 * 123_520 and bf16.activations < single.activations
    full = predict_memory(base.replace(model=dataclasses.replace(base.model, recompute_granularity="full")),
                          {"dp_shard": 1})
    assert full.activations < single.activations
    tp = predict_memory(base.replace(parallel=ParallelConfig(tp=2)), {"tp": 2})
    assert tp.activations < single.activations and tp.params < single.params


def test_scanned_layers_keep_their_values_whatever_the_recompute_and_hold_two_gradient_copies():
    """torch's scan keeps what its partitioner chooses (recompute changes nothing, measured) and the
    backward loop's stacked layer gradients are held next to every layer's kept values."""
    base = WORKED.validate(1)
    scan = dataclasses.replace(base.model, scan_layers=True)
    unrolled = predict_memory(base, {"dp_shard": 1})
    scanned = predict_memory(base.replace(model=scan), {"dp_shard": 1})
    scanned_full = predict_memory(base.replace(model=dataclasses.replace(scan, recompute_granularity="full")),
                                  {"dp_shard": 1})
    layer_params = local_params(scan, {"dp_shard": 1}, prefix="layers.")
    assert layer_params == local_params(base.model, {"dp_shard": 1}, prefix="layers.") > 0
    assert scanned.params == unrolled.params and scanned.activations == unrolled.activations
    assert unrolled.scan_gradients == 0 and scanned.scan_gradients == 2 * 4 * layer_params
    assert scanned.peak == unrolled.peak + scanned.scan_gradients
    assert scanned_full.activations == scanned.activations and scanned_full.peak == scanned.peak
    assert ("scanned layers' stacked gradients (backward)", scanned.scan_gradients) in scanned.rows()
    assert scanned.notes == () and "saves no memory with model.scan_layers" in scanned_full.notes[0]


def test_cli_errors_are_clear(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(WORKED_FLAGS + ["--parallel.tp", "2", "--world-size", "3"])
    assert exit_info.value.code == 2
    assert "world size 3 is not divisible by the product of the other parallel sizes (2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(WORKED_FLAGS + ["--parallel.tp", "2", "--parallel.dp-shard", "1", "--world-size", "3"])
    assert "do not multiply to the world size 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(WORKED_FLAGS + ["--world-size", "0"])
    assert "--world-size must be positive" in capsys.readouterr().err
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            plan_main(WORKED_FLAGS + ["--parallel.tp", bad])
        assert f"parallel.tp must be a positive integer or -1 (the rest of the world), got {bad}" in capsys.readouterr().err


def test_a_size_of_minus_one_and_an_unset_dp_shard_are_the_rest_of_the_world():
    """``-1`` takes the world size over the other sizes (pp -1 on 2 ranks is a 2-stage pipeline,
    checked as one); an unset dp_shard does so when no size is -1 (Megatron's data-parallel size),
    with the ep ranks carved out of it; explicit sizes must still multiply."""
    pp_rest = WORKED.replace(parallel=ParallelConfig(pp=-1), run=RunConfig(micro_batch_size=2, global_batch_size=8))
    assert pp_rest.validate(2).parallel.pp == 2 and pp_rest.validate(2).parallel.dp_shard == 1
    assert pp_rest.validate(1).parallel.pp == 1
    with pytest.raises(ConfigError, match=r"model.num_layers \(2\) is not divisible by the pipeline's stages .* = 4\)"):
        pp_rest.validate(4)
    tp2 = WORKED.replace(parallel=ParallelConfig(tp=2)).validate(8)
    assert (tp2.parallel.tp, tp2.parallel.dp_shard, tp2.run.global_batch_size) == (2, 4, 4 * WORKED.run.micro_batch_size)
    assert ParallelConfig(ep=2).sizes(2) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "ep": 2, "cp": 1, "tp": 1}
    assert ParallelConfig(dp_replicate=2, tp=-1).sizes(8)["dp_shard"] == 1
    assert ParallelConfig(tp=2, dp_shard=-1).resolved(6) == ParallelConfig(tp=2, dp_shard=3)
    with pytest.raises(ConfigError, match=r"parallel sizes \(dp_shard 2 x tp 2 = 4\) do not multiply to the world size 8"):
        ParallelConfig(tp=2, dp_shard=2).sizes(8)


def test_a_cuda_plan_counts_cublas_workspace(monkeypatch):
    """The caching allocator holds cuBLAS's workspace (32 MiB on an H200, measured): a cuda plan adds
    torch's default for the GPU's compute capability, or CUBLAS_WORKSPACE_CONFIG's size."""
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = WORKED.validate(1)
    on_cpu = predict_memory(base.replace(run=dataclasses.replace(base.run, device="cpu")), {"dp_shard": 1})
    cuda_cfg = base.replace(run=dataclasses.replace(base.run, device="cuda"))
    assumed = predict_memory(cuda_cfg, {"dp_shard": 1})
    assert on_cpu.workspace == 0 and "cuBLAS workspace (CUDA)" not in dict(on_cpu.rows())
    assert assumed.workspace == 32 * 2**20 and assumed.peak == on_cpu.peak + 32 * 2**20
    assert dict(assumed.rows())["cuBLAS workspace (CUDA)"] == 32 * 2**20
    assert "assumes compute capability 9.0" in assumed.notes[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    ampere = predict_memory(cuda_cfg, {"dp_shard": 1})
    assert ampere.workspace == 8 * 2**20 + 128 * 2**10 and ampere.notes == ()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert predict_memory(cuda_cfg, {"dp_shard": 1}).workspace == 16 * 8 * 1024


def test_context_parallel_divides_every_per_token_value_and_gathers_the_keys_again():
    """cp 2: every per-token value counts half the sequence, the keys and values too (the backward
    gathers them again: ``lmfunc.compiler.regather``); the peak falls in one attention backward,
    which adds two dense [S/2, S] masks (fp32 here), the whole sequence's keys and values gathered
    again and the query, key and value gradients, next to the kept values and the gradient bucket."""
    m = dataclasses.replace(WORKED.model, activation="swiglu", normalization="RMSNorm")
    whole = WORKED.replace(model=m, run=RunConfig(micro_batch_size=2, global_batch_size=2))
    split = whole.replace(parallel=ParallelConfig(cp=2))
    one, two = plan_of(whole).lmfunc, plan_of(split, 2).lmfunc
    kv = m.query_groups * m.head_dim
    assert two.state == one.state and two.grads == one.grads
    assert two.activations == pytest.approx(one.activations / 2)
    assert two.head == one.head // 2
    masks = 2 * 64 * 128 * 4  # mask batch 1 without document masks
    grads = 2 * (64 * m.num_attention_heads * m.head_dim + 2 * 128 * kv) * 4
    gathered = 2 * 2 * 128 * kv * 4  # the keys and values of both sequences, whole, fp32
    assert two.attention_backward == masks + gathered + grads and one.attention_backward == 0
    assert two.peak == two.state + max(two.activations + two.head, two.activations + two.grads + two.attention_backward)
    docs = split.replace(data=dataclasses.replace(split.data, reset_attention_mask=True))
    assert plan_of(docs, 2).lmfunc.attention_backward == 2 * masks + gathered + grads  # one mask per sequence
    assert "attention backward over cp" in format_plan(plan_of(split, 2))
