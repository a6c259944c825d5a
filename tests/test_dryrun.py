"""``python -m lmfunc.dryrun``: the trainer's step for a target world traced on fake tensors and a fake
process group. Against real runs: tests/test_parallel.py holds the dry run's collectives and their
elements to those its compiled runs measured (``tests.dryrun_check``)."""

import json

import pytest

from lmfunc.compiler.torch_compat import torch_at_least
from lmfunc.config import ConfigError, model_preset
from lmfunc.dryrun.__main__ import dry_run
from lmfunc.plan.report import make_plan
from lmfunc.config.command_line import parse_config

TINY = ["--preset", "tiny", "--run.micro-batch-size", "2", "--run.global-batch-size", "8", "--data.seq-length", "64"]
TINY_FSDP = [*TINY, "--parallel.dp-shard", "2", "--world-size", "2", "--gpus-per-node", "1"]


@pytest.fixture(scope="module")
def refused_fsdp_run(tmp_path_factory):
    """The tiny model on dp_shard 2, one GPU per node, on a GPU of 1 MiB: the report is printed
    and written, then the layout is refused as out of memory."""
    out = tmp_path_factory.mktemp("dryrun") / "report.json"
    with pytest.raises(ConfigError) as refused:
        dry_run(TINY_FSDP + ["--gpu-memory-gib", str(1 / 1024), "--json", str(out)])
    return json.loads(out.read_text()), str(refused.value)


def test_fsdp_dry_run_gives_the_bucketed_collectives_and_megatrons_flops(refused_fsdp_run):
    """One gather per region and microbatch and one more per block in the backward, one reduce-scatter
    per region and microbatch, over dp_shard, across nodes (one GPU per node); the FLOPs on the
    graph equal Megatron's count for the rank's share of the batch."""
    from experiments.bench.comm import expected_compiled_counts

    report, _ = refused_fsdp_run
    role = report["roles"][0]
    counts = {c["kind"]: c["count"] for c in role["collectives"]}
    want = expected_compiled_counts(model_preset("tiny"), {"dp_shard": 2}, microbatches=2, loss_mask=True, gloo=False)
    assert counts == {k: v for k, v in want.items() if v}
    assert {(c["dims"], c["group_size"], c["link"]) for c in role["collectives"]} == {("dp_shard", 2, "network")}
    cfg, _ = parse_config(TINY_FSDP[:-4], "x", "x")
    assert role["flops"] == make_plan(cfg.validate(2), 2).megatron.flops_per_iteration / 2
    projection = role["projection"]
    assert projection["step_seconds"] >= projection["compute_seconds"] > 0 and 0 < projection["mfu"] <= 1
    assert role["memory"]["peak_bytes"] > role["memory"]["input_bytes"] > 0
    # the backward gathers each block's parameters again (lmfunc.compiler.regather): within 12% of the
    # plan (+11.9% on this AMD EPYC since the tied embedding's two reductions stay two buckets per
    # microbatch, +8.6% before), where keeping every gathered parameter for the backward read +31.6%
    assert role["memory"]["peak_bytes"] < 1.12 * role["memory"]["plan_peak_bytes"]
    # the peak, in the second microbatch's backward, split as the plan splits its own: the inputs, the
    # gradients (the first microbatch's reduce-scattered shards, summed, and this one's buckets), the
    # activations kept for the backward (-9.0% of the plan's on the AMD EPYC: the last layer's are
    # partly consumed) and the working set
    terms = {t["term"]: (t["bytes"], t["plan_bytes"]) for t in role["memory"]["terms"]}
    assert list(terms) == ["state and batch", "gradients", "kept activations", "working set"]
    assert sum(got for got, _ in terms.values()) == role["memory"]["peak_bytes"]
    assert sum(plan for _, plan in terms.values()) == role["memory"]["plan_peak_bytes"]
    assert terms["state and batch"][0] == role["memory"]["input_bytes"]
    gradients, gradients_plan = terms["gradients"]
    assert gradients_plan < gradients < 2 * gradients_plan
    assert terms["kept activations"][0] == pytest.approx(terms["kept activations"][1], rel=0.15)


def test_a_layout_that_does_not_fit_is_refused_naming_the_role_and_its_largest_term(refused_fsdp_run):
    _, message = refused_fsdp_run
    assert "out of memory on rank role 'every rank' (rank 0)" in message
    assert "the largest term is" in message and "the working set" in message  # not the state


def test_a_refusal_names_the_largest_live_buffer_only_where_it_can_be_part_of_the_largest_term():
    from lmfunc.dryrun.graph_report import MemoryReport
    from lmfunc.dryrun.report import Hardware, RoleReport, check_fits

    gib = 2**30
    gpu = Hardware("test GPU", 1e15, 10 * gib, 1e11, 1e10)

    def refusal(largest: list[tuple[str, int]]) -> str:
        terms = (("state and batch", 1 * gib), ("kept activations", 8 * gib), ("working set", 3 * gib))
        memory = MemoryReport(12 * gib, 1 * gib, "node 7", largest, terms)
        with pytest.raises(ConfigError) as refused:
            check_fits(RoleReport("first pipeline rank", 0, 0.0, "traced", memory, [], 0, 0, 0.0, 0.0, None, 0.0), gpu)
        return str(refused.value)

    one_graph = refusal([("buf9 (aten.mm.default)", 2 * gib)])
    assert ("the step's peak is 12.0 GiB, the test GPU has 10.0 GiB; the largest term is 8.0 GiB: the activations "
            "kept for the backward; the largest of what is live there: buf9 (aten.mm.default) of 2.0 GiB.") in one_graph
    # a pipeline role's largest entry is the sum of what its graphs keep between them, more than the term
    pipeline = refusal([("kept between the graphs (state, saved activations, gradients)", 9 * gib)])
    assert "the largest term is 8.0 GiB: the activations kept for the backward. Shard more" in pipeline


@pytest.mark.parametrize("flags, message", [
    (["--parallel.pp", "3", "--world-size", "3"], r"model.num_layers \(2\) is not divisible by the pipeline's stages"),
    (["--parallel.pp", "2", "--world-size", "2", "--run.global-batch-size", "2"],
     "needs at least as many microbatches per step as stages"),
    (["--parallel.dp-shard", "2", "--world-size", "4"], "do not multiply to the world size 4"),
    (["--world-size", "1", "--gpu", "a100"], "--gpu must be one of"),
    (["--world-size", "1", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be positive, got 0"),
    (["--world-size", "1", "--expert-load", "0"], "--expert-load must be positive, got 0"),
    (["--world-size", "1", "--expert-load", "1.5"],
     r"--expert-load 1.5: no rank exchanges the experts' rows without expert parallelism \(parallel.ep is 1"),
])
def test_what_the_run_would_refuse_is_refused_before_tracing(flags, message):
    with pytest.raises(ConfigError, match=message):
        dry_run([*TINY, *flags])


def test_each_microbatchs_gradients_are_added_to_the_sum_before_the_next_microbatch():
    """One layer on dp_shard 2: the step's buffers peak no higher at 4 microbatches than at 2, since
    each microbatch's reduce-scattered gradient shards are added to the sum before the next
    microbatch begins (``lmfunc.compiler.accumulation_order``; without it Inductor sums them all at
    the end, one set of shards more per microbatch: +18%). The collectives are the expected buckets
    (the tied embedding's two reductions never merged across microbatches)."""
    import dataclasses

    from experiments.bench.comm import expected_compiled_counts
    from lmfunc.dryrun import step_facts, trace_rank

    peaks = {}
    for microbatches in (2, 4):
        cfg, _ = parse_config([*TINY, "--model.num-layers", "1", "--run.global-batch-size", str(4 * microbatches),
                               "--parallel.dp-shard", "2"], "x", "x")
        facts = step_facts(trace_rank(cfg.validate(2), 2))
        peaks[microbatches] = facts.memory.peak - facts.memory.inputs
    assert peaks[4] <= peaks[2] * 1.03, peaks
    counts = {use.kind: use.count for use in facts.collectives}
    model = dataclasses.replace(model_preset("tiny"), num_layers=1)
    want = expected_compiled_counts(model, {"dp_shard": 2}, microbatches=4, loss_mask=True, gloo=False)
    assert counts == {k: v for k, v in want.items() if v}


@pytest.mark.slow  # ten traces of the tiny model: 2.3 minutes alone, 5 in CI beside another test
def test_an_extrapolated_step_equals_the_whole_step_traced():
    """5 layers x 4 microbatches on dp_shard 2: the numbers extrapolated from 1-4 layers and 1-3
    microbatches equal those of the whole step traced at once (collectives and FLOPs exactly,
    the peak, fitted at 2 and 4 layers, within the extrapolation's tolerance)."""
    from lmfunc.dryrun import dry_run_facts, step_facts, trace_rank
    from lmfunc.dryrun.extrapolate import MEMORY_TOLERANCE

    cfg, _ = parse_config([*TINY, "--model.num-layers", "5", "--run.global-batch-size", "16",
                           "--parallel.dp-shard", "2"], "x", "x")
    cfg = cfg.validate(2)
    extrapolated, whole = dry_run_facts(cfg, 2), step_facts(trace_rank(cfg, 2))
    assert "extrapolated to 5 layers and 4 microbatches" in extrapolated.traced and "fitted at 2 and 4" in extrapolated.traced
    assert extrapolated.collectives == whole.collectives and extrapolated.flops == whole.flops
    assert extrapolated.memory.inputs == whole.memory.inputs
    assert extrapolated.memory.peak == pytest.approx(whole.memory.peak, rel=MEMORY_TOLERANCE)


def test_a_pipeline_dry_run_reports_each_stage_role():
    """pp 2, 1F1B, 4 microbatches of 2 x 64 tokens: the first and the last pipeline rank are traced
    (their stages' compiled forward and backward, the schedule's sends, the update); their FLOPs add
    up to Megatron's count for the step; each rank sends one activation (or gradient) of
    ``[2, 64, h]`` fp32 per microbatch and receives as many, into a buffer per microbatch that its
    stage keeps (the plan's receive buffers, exactly); the tied embedding's gradient is summed
    over the first and last stage. Each role's peak is split as the plan splits it."""
    cfg, _ = parse_config([*TINY, "--parallel.pp", "2"], "x", "x")
    cfg = cfg.validate(2)
    report = dry_run([*TINY, "--parallel.pp", "2", "--world-size", "2"])
    first, last = report["roles"]
    assert (first["role"], first["rank"], last["role"], last["rank"]) == ("first pipeline rank", 0,
                                                                         "last pipeline rank", 1)
    assert first["flops"] + last["flops"] == make_plan(cfg, 2).megatron.flops_per_iteration
    activation = 2 * 64 * cfg.model.hidden_size
    embedding = cfg.model.vocab_size * cfg.model.hidden_size
    for role in (first, last):
        sent = {(c["kind"], c["dims"]): (c["count"], c["elements"]) for c in role["collectives"]}
        assert sent[("send", "pp")] == sent[("recv", "pp")] == (4, 4 * activation)
        assert sent[("all_reduce", "pp")] == (3, embedding + 2)  # the tied embedding; the norm and the metrics
        assert role["memory"]["peak_bytes"] > role["memory"]["input_bytes"] > 0
        assert role["projection"]["bubble_seconds"] == pytest.approx(role["projection"]["compute_seconds"] / 4)
        # the peak split as the plan splits it; torch 2.13 and 2.14's stages keep a receive buffer
        # per microbatch (the first stage's for gradients, the last's for activations), as many as the
        # plan counts; 2.15's allocate one per receive and hand it to the stage, which frees it with
        # the microbatch's backward, so at most as many (the plan models 2.13's: docs/architecture.md)
        terms = {t["term"]: (t["bytes"], t["plan_bytes"]) for t in role["memory"]["terms"]}
        assert sum(got for got, _ in terms.values()) == role["memory"]["peak_bytes"]
        if torch_at_least(2, 15):
            assert terms["receive buffers"][1] == 4 * activation * 4
            assert terms["receive buffers"][0] in [k * activation * 4 for k in (1, 2, 3, 4)]
        else:
            assert terms["receive buffers"] == (4 * activation * 4, 4 * activation * 4)
        assert terms["state and batch"][0] == role["memory"]["input_bytes"]


def test_a_peak_between_the_graphs_is_split_by_what_made_it():
    """The pipeline recorder keeps, with its largest total between the graphs, what made each byte
    alive then (the report's breakdown, and the out-of-memory message's largest term, when a rank
    peaks outside its graphs), not what is alive at the end."""
    import torch

    from lmfunc.dryrun.pipeline import StepRecorder

    recorder = StepRecorder()
    with recorder:
        first = torch.empty(1024)
        second = torch.empty(512)
        del first
        third = torch.zeros(256)
    assert recorder.peak_between_graphs == 6144
    assert recorder.makers_at_peak == {"eager empty": 6144}
    assert +recorder.by_maker == {"eager empty": 2048, "eager zeros": 1024}
    del second, third


def test_a_v_schedules_bubble_counts_its_two_stages_per_rank():
    """zbv on pp 2 holds two stages per rank (a V): Megatron's bubble ``(pp - 1) / (v m)`` with v = 2
    and 4 microbatches is an eighth of the compute, on both ranks."""
    report = dry_run([*TINY, "--parallel.pp", "2", "--world-size", "2", "--parallel.pp-schedule", "zbv",
                      "--model.num-layers", "4"])
    for role in report["roles"]:
        projection = role["projection"]
        assert projection["bubble_seconds"] == pytest.approx(projection["compute_seconds"] / 8)


def test_tensor_parallel_without_sp_computes_megatrons_flops_on_the_shards():
    """tp 2 without sequence parallelism, compiled: the step's FLOPs are Megatron's count for one tp
    rank exactly, and tp's only collectives are all-reduces (Megatron's ``f`` and ``g`` and the
    vocab-parallel loss's). When the gradient of a column-parallel input stayed a partial sum in
    the compiled backward, every row-parallel weight was all-gathered and multiplied whole: 18%
    more FLOPs, with all-gathers and reduce-scatters over tp."""
    flags = [*TINY, "--run.global-batch-size", "2", "--parallel.tp", "2"]
    cfg, _ = parse_config(flags, "x", "x")
    cfg = cfg.validate(2)
    (role,) = dry_run([*flags, "--world-size", "2"])["roles"]
    assert role["flops"] == make_plan(cfg, 2).megatron.flops_per_iteration / 2
    assert {c["kind"] for c in role["collectives"] if c["dims"] == "tp"} == {"all_reduce"}


@pytest.mark.parametrize("layout", [["--parallel.cp", "2", "--parallel.dp-shard", "2"],
                                    ["--parallel.tp", "2", "--parallel.dp-shard", "2", "--model.sequence-parallel"]],
                         ids=["cp2-dp_shard2", "tp2-sp-dp_shard2"])
def test_activations_split_along_batch_and_sequence_compile_with_mtp(layout):
    """The compiled step of a layout that splits the tokens along the batch and along the sequence
    (cp beside dp_shard; tp with SP beside dp_shard, where MTP's ``eh_proj`` takes the sequence split),
    with an MTP depth: Dynamo stopped at the first such projection (``PendingUnbackedSymbolNotFound``)
    until ``placement.linear`` multiplied each rank's tokens as rows. FLOPs within 1% of Megatron's
    count for the rank's share; with cp within 10%: its attention multiplies the local queries by
    every gathered key under a dense mask, where Megatron counts the causal half (+9% on cp 2 alone)."""
    (role,) = dry_run([*TINY, "--model.mtp-num-layers", "1", *layout, "--world-size", "4"])["roles"]
    split_dim = "cp" if "--parallel.cp" in layout else "tp"
    assert any(c["dims"] == split_dim for c in role["collectives"]), role["collectives"]
    assert role["flops"] == pytest.approx(role["plan_flops"], rel=0.01 if split_dim == "tp" else 0.1)


def test_leaves_split_over_two_mesh_dims_compile_with_bucketed_collectives():
    """dp_shard 4 x ep 2 (``deepseek-v3-tiny``): the dense leaves are split over ep and over the rest
    of dp_shard, so each is gathered over one dim and then over the other, and its gradient reduced
    the same way. The collective pass's prefetch order put a bucket before the wait of the one it
    reads, a cycle that stopped Inductor (``AssertionError`` in its topological sort) until
    ``collective_buckets._without_cycles`` left such edges out. FLOPs within 3% of Megatron's even
    share."""
    ds = ["--preset", "deepseek-v3-tiny", "--model.mtp-num-layers", "0", "--run.micro-batch-size", "2",
          "--run.global-batch-size", "8", "--data.seq-length", "64"]
    (role,) = dry_run([*ds, "--parallel.dp-shard", "4", "--parallel.ep", "2", "--world-size", "4"])["roles"]
    gathered = {c["dims"] for c in role["collectives"] if c["kind"] == "all_gather_into_tensor"}
    assert {"dp_shard", "ep"} <= gathered, role["collectives"]
    assert role["flops"] == pytest.approx(role["plan_flops"], rel=0.03)


def test_compiled_stages_beside_dp_shard_gather_their_weights_again_in_the_backward():
    """pp 2 x dp_shard 2, 1F1B: each microbatch's forward all-gathers every parameter use whose
    gradient it reduce-scatters, and its backward gathers again those its input gradient reads
    (``lmfunc.compiler.regather``): every one on the last rank (its layers and output layer), all
    but the embedding table on the first (an embedding's gradient does not read its table). So a
    microbatch in flight keeps no gathered parameter, nor a copy made from one, and each rank's
    peak stays within 12% of the plan (the first rank's was 24% above when every microbatch in
    flight kept its stage's gathered parameters, 10% while it kept the copies)."""
    report = dry_run([*TINY, "--parallel.pp", "2", "--parallel.dp-shard", "2", "--world-size", "4"])
    first, last = report["roles"]
    for role, regathered in ((first, lambda reductions: reductions - 2), (last, lambda reductions: reductions)):
        counts = {(c["kind"], c["dims"]): c["count"] for c in role["collectives"]}
        gathers, reductions = counts[("all_gather_into_tensor", "dp_shard")], counts[("reduce_scatter_tensor", "dp_shard")]
        assert gathers == reductions + regathered(reductions), role["role"]  # 2 microbatches
        memory = role["memory"]
        assert memory["peak_bytes"] < 1.12 * memory["plan_peak_bytes"], role["role"]


@pytest.mark.slow  # two pipeline roles of MoE, MLA and MTP stages traced on two layouts: about 80 s
def test_deepseek_stages_keep_no_copy_of_a_parameter_and_recompute_no_layer():
    """deepseek-v3-tiny (MLA, MoE, MTP) in bf16 on pp 2 x ep 2, its dense leaves FSDP over ep: the
    stages' forward keeps neither the bf16 copies of the gathered parameters nor the
    concatenations that put a leaf together (``regather.tag_input_copies``): each rank's peak is
    within 10% of the plan (the last rank read +12.6% while it kept them), and the two ranks' FLOPs
    add up to Megatron's count for the step within 2% (+0.7%: the last rank's MTP depth and output
    layer are not in the even share; with the integer inputs' copies tagged too, the last stage
    recomputed its MTP layer in the backward: +12.7%)."""
    ds = ["--preset", "deepseek-v3-tiny", "--run.micro-batch-size", "2", "--run.global-batch-size", "8",
          "--data.seq-length", "64", "--precision.compute-dtype", "bf16"]
    report = dry_run([*ds, "--parallel.pp", "2", "--parallel.dp-shard", "2", "--parallel.ep", "2", "--world-size", "4"])
    for role in report["roles"]:
        memory = role["memory"]
        assert memory["peak_bytes"] == pytest.approx(memory["plan_peak_bytes"], rel=0.10), role["role"]
    first, last = report["roles"]
    assert first["flops"] + last["flops"] == pytest.approx(2 * first["plan_flops"], rel=0.02)
    # pp 2 alone: the stages' backward graphs hold a real constant tensor, which AOTAutograd's lazy
    # backward compile deep-copied under the fake mode and failed on (``capture.capturing_backend``
    # compiles each backward with its forward instead)
    alone = dry_run([*ds, "--parallel.pp", "2", "--world-size", "2"])
    for role in alone["roles"]:
        memory = role["memory"]
        assert memory["peak_bytes"] == pytest.approx(memory["plan_peak_bytes"], rel=0.10), role["role"]


def test_a_pipeline_dry_run_with_selective_recompute_beside_tp_counts_the_recomputed_attention():
    """pp 2 x tp 2 with SP, selective recompute: the stages compile (their recomputed attention's saved RNG
    state is placed before the saved mesh, ``lmfunc.compiler.saved_rng_states``), and the FLOPs on
    the graphs are Megatron's count plus one more attention forward per layer and microbatch (the
    recomputation: ``2 B S^2 h`` causal), the attention wrapped in AOTAutograd's RNG operators
    counted like any other."""
    flags = [*TINY, "--parallel.pp", "2", "--parallel.tp", "2", "--model.sequence-parallel",
             "--model.recompute-granularity", "selective"]
    cfg, _ = parse_config(flags, "x", "x")
    cfg = cfg.validate(4)
    report = dry_run([*flags, "--world-size", "4"])
    m = cfg.model
    recomputed = m.num_layers * 4 * 2 * 2 * 64 * 64 * m.hidden_size // 2  # per tp rank: h / 2 of the heads
    total = sum(role["flops"] for role in report["roles"])
    assert total == make_plan(cfg, 4).megatron.flops_per_iteration / 2 + recomputed


@pytest.mark.slow  # a torchrun launch of compiled pipeline steps and its dry runs: about a minute and a half
@pytest.mark.multirank
def test_a_pipeline_dry_run_equals_the_measured_run(tmp_path):
    """The pipeline benchmark's compiled run (``experiments.bench.pipeline``, pp 2, interleaved 1F1B
    with 2 virtual stages, 4 microbatches, torchrun, gloo) against the dry run of the same workload,
    per rank: the collectives and the point-to-point messages of one step, kind by kind, equal in
    count and elements; the step memory within 10% (the stages' receive buffers, kept from the
    first step, counted on both sides). Interleaved, because each rank then sends and
    receives in both directions for each of its two stages; plain 1F1B's messages are held to their
    expected counts in ``test_a_pipeline_dry_run_reports_each_stage_role``."""
    import dataclasses

    from experiments.bench.pipeline import WORKLOAD, _train_config
    from lmfunc.dryrun.pipeline import trace_pipeline_rank
    from tests.helpers import run_torchrun

    schedule, virtual = "interleaved-1f1b", 2
    out = tmp_path / "measured.json"
    run_torchrun(2, ["-m", "experiments.bench.pipeline", "--schedule", schedule, "--virtual-stages", str(virtual),
                     "--microbatches", "4", "--steps", "1", "--memory", "--compile", "--json", str(out)])
    measured = json.loads(out.read_text())["ranks"]
    w = WORKLOAD
    model = dataclasses.replace(model_preset("tiny", num_layers=w["num_layers"], hidden_size=w["hidden_size"]),
                                tie_embeddings=False, scan_layers=False, max_position_embeddings=w["seq"])
    cfg = _train_config(model, schedule, 2, virtual, 4).validate(2)
    for rank, want in enumerate(measured):
        facts = trace_pipeline_rank(cfg, 2, rank)
        sent = {use.kind: [use.count, use.elements] for use in facts.collectives}
        assert sent == want["collectives"], (rank, sent, want["collectives"])
        assert facts.memory.peak == pytest.approx(want["memory_bytes"], rel=0.10), rank


@pytest.mark.slow  # three MoE traces: about a minute
def test_the_experts_matmuls_are_counted_on_one_rank_and_at_an_even_share_under_expert_parallelism():
    """The experts' grouped matmuls (``lmfunc::grouped_mm`` and its weight gradient) count: on one
    rank the MoE step's FLOPs are Megatron's count within 1% (the router's matmul is the rest);
    under expert parallelism the rows each rank's experts get are known only at run time: taken at
    an even share of the tokens (``lmfunc.train.run_step.even_expert_share``), the step's FLOPs are Megatron's
    even share within 1% too, and the report says how many ops it sized so."""
    moe = ["--preset", "moe-small", "--run.micro-batch-size", "2", "--run.global-batch-size", "4",
           "--data.seq-length", "128"]
    one = dry_run([*moe, "--world-size", "1"])["roles"][0]
    assert one["flops"] == pytest.approx(one["plan_flops"], rel=0.01) and one["flops_estimated_ops"] == 0
    split = dry_run([*moe, "--parallel.ep", "2", "--parallel.dp-shard", "2", "--world-size", "2"])["roles"][0]
    assert split["flops"] == pytest.approx(split["plan_flops"], rel=0.01) and split["flops_estimated_ops"] > 0
    # the buffers of the exchanged rows are counted at that share too (Inductor's own timeline
    # counts a buffer of a run-time size as 0 bytes: the peak read 42-45% below the measured one)
    assert split["memory"]["peak_bytes"] == pytest.approx(split["memory"]["plan_peak_bytes"], rel=0.10)
    busier = dry_run([*moe, "--parallel.ep", "2", "--parallel.dp-shard", "2", "--world-size", "2",
                      "--expert-load", "1.5"])["roles"][0]
    assert "1.5x an even share" in busier["role"]
    assert split["memory"]["peak_bytes"] < busier["memory"]["peak_bytes"] < 1.5 * split["memory"]["peak_bytes"]
    assert split["flops"] < busier["flops"] < 1.5 * split["flops"]


def test_every_readme_dry_run_command_is_a_valid_config():
    """The README's ``lmfunc.dryrun`` commands parse and validate for their world (nothing traced:
    docs/scale_out.md shows the output of the Llama-3-8B one)."""
    import os
    import shlex

    from lmfunc.dryrun.__main__ import TARGET_OPTIONS
    from lmfunc.plan.report import world_size_for

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in open(os.path.join(root, "README.md")).read().splitlines()
             if line.startswith("python -m lmfunc.dryrun")]
    assert lines
    for line in lines:
        words = [w.replace("configs/", os.path.join(root, "configs/")) for w in shlex.split(line.split("#")[0])[3:]]
        cfg, known = parse_config(words, "x", "x", extra=TARGET_OPTIONS)
        cfg.validate(world_size_for(cfg, known.world_size))


def test_a_scanned_step_counts_its_loop_once_per_layer():
    """With ``scan_layers`` Inductor lowers the layers' scan to a ``while_loop``: its body's FLOPs
    count once per iteration, so the step's equal Megatron's count, as unrolled."""
    from lmfunc.dryrun import step_facts, trace_rank

    cfg, _ = parse_config([*TINY, "--run.global-batch-size", "4", "--model.scan-layers"], "x", "x")
    cfg = cfg.validate(1)
    assert step_facts(trace_rank(cfg, 1)).flops == make_plan(cfg, 1).megatron.flops_per_iteration


def test_the_values_of_one_graph_are_told_apart_as_gradients_kept_activations_or_neither():
    """A step of two microbatches through an embedding and two matmuls, each tensor of its own shape,
    its gradients summed and applied, captured as the dry run captures the trainer's step: the
    weights' gradients (made in the backward, read outside it) and their sum are gradients, no
    value over the tokens is one; the forward's values over the tokens are made from the batch and
    lie outside the backward, the weights alone are not from the batch."""
    import torch

    from lmfunc.compiler.compiling import compile_step, inductor_options
    from lmfunc.dryrun.buffer_terms import ValueTerms
    from lmfunc.dryrun.capture import _Captured, capturing_backend
    from lmfunc.grad import value_and_grad

    tokens, width, hidden, outputs, vocab = 6, 5, 7, 3, 11
    weight_shapes = {(vocab, width), (width, hidden), (hidden, outputs)}

    def loss(params, ids):
        activations = torch.tanh(params["embed"][ids] @ params["w1"])  # [tokens, hidden]
        return (activations @ params["w2"]).square().mean()

    def step(params, batch):
        total = None
        for ids in batch.unbind(0):
            _, grads = value_and_grad(loss)(params, ids)
            total = grads if total is None else {name: total[name] + grads[name] for name in grads}
        return {name: params[name] - 0.1 * total[name] for name in params}

    params = {"embed": torch.randn(vocab, width), "w1": torch.randn(width, hidden), "w2": torch.randn(hidden, outputs)}
    sink: list = []
    compiled = compile_step(step, backend=capturing_backend(sink, inductor_options(True, None)))
    with pytest.raises(_Captured):  # the capture stops before code generation
        compiled(params, torch.randint(0, vocab, (2, tokens)))
    values = ValueTerms(sink[-1][0].graph)

    def shape(node):
        value = node.meta.get("val")
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    gradients = {shape(node) for node in values.gradients}
    assert gradients == weight_shapes, gradients
    for weight in weight_shapes:  # made in the backward, and summed outside it
        assert {node in values.backward for node in values.gradients if shape(node) == weight} == {True, False}
    over_tokens = [node for node in values.nodes if (shape(node) or (0,))[0] == tokens and node.op == "call_function"]
    forward = [node for node in over_tokens if node not in values.backward]
    assert forward and all(node in values.from_batch for node in forward)
    assert any(node in values.backward for node in over_tokens)
    assert not any(node in values.from_batch for node in values.nodes if node.op == "placeholder" and shape(node) in weight_shapes)
