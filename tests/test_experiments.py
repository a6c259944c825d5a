"""Each study's ``--quick`` mode runs end to end and checks its own invariants (the script exits
non-zero when one fails), so the experiments cannot rot. They take one to a few minutes each."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(study: str, out, *extra: str) -> dict:
    """``python -m experiments.STUDY --quick --out OUT [EXTRA]``; its summary.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", f"experiments.{study}", "--quick", "--out", str(out), "--threads", "1",
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "invariants hold" in done.stdout
    return json.loads((out / "results" / "summary.json").read_text())


@pytest.mark.slow
def test_loss_scale_study_quick(tmp_path):
    summary = run_quick("loss_scale", tmp_path)
    runs = summary["runs"]
    assert runs["fp16_unscaled"]["max_underflow"] > 0 and runs["fp16_dynamic_megatron"]["skipped_steps"] > 0
    assert summary["clip_order_example"]["shrink_factor"] > 1
    assert (tmp_path / "loss_curves.png").stat().st_size > 0 and (tmp_path / "loss_scale_and_underflow.png").exists()
    # The tables and plots are redrawn from the raw results alone.
    os.remove(tmp_path / "loss_curves.png")
    subprocess.run([sys.executable, "-m", "experiments.loss_scale", "--quick", "--out", str(tmp_path), "--report-only"],
                   cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "loss_curves.png").exists()


@pytest.mark.slow
def test_mtp_study_quick(tmp_path):
    """The study's invariants hold: each depth logs its MTP losses, below the untrained loss. (Its
    timing invariant, each MTP depth slower than none, is the full study's: it compares runs made
    one after another, which a test beside another worker's compile cannot.)"""
    runs = run_quick("mtp", tmp_path)["runs"]
    assert set(runs["depth2_lambda0.3"]["mtp_losses"]) == {"mtp_1_loss", "mtp_2_loss"}
    assert (tmp_path / "mtp.png").exists()


@pytest.mark.slow
def test_precision_study_quick(tmp_path):
    summary = run_quick("precision", tmp_path)
    assert set(summary["quality"]) == {"fp32", "bf16", "fp16"} and summary["machine"]["cpu"]
    assert (tmp_path / "precision_curves.png").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_invariance_study_quick(tmp_path):
    layouts = run_quick("invariance", tmp_path)["layouts"]
    assert len(layouts) == 6 and all(r["max_train_delta"] < 1e-4 and r["train_points"] == 12 for r in layouts.values())
    assert (tmp_path / "invariance.png").exists()


PLAN_ACCURACY_ONE_PROCESS = ("quick_none", "quick_full", "quick_scan_none")
PLAN_ACCURACY_SEVERAL_RANKS = ("quick_cp2", "quick_moe_ep2", "quick_tp2_sp")
"""The quick plan-accuracy cases, split so that only the torchrun ones hold the multi-rank slot."""


@pytest.mark.slow
def test_plan_accuracy_study_quick(tmp_path):
    """The one-process cases: within 15% of the measured peak, the dry run's peak held beside it,
    full recompute below none."""
    cases = run_quick("plan_accuracy", tmp_path, "--cases", ",".join(PLAN_ACCURACY_ONE_PROCESS))["cases"]
    assert set(cases) == set(PLAN_ACCURACY_ONE_PROCESS)
    assert all(abs(c["error"]) <= 0.15 for c in cases.values())
    assert all("dry_run_mib" in c for c in cases.values())  # held within 10% where it counts every buffer
    assert cases["quick_full"]["measured_mib"] < cases["quick_none"]["measured_mib"]
    assert (tmp_path / "plan_accuracy.png").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_plan_accuracy_study_quick_on_several_ranks(tmp_path):
    """The torchrun cases (cp 2; dp_shard 2 x ep 2; tp 2 + SP): the most-loaded rank within 15%. On cp 2 the
    dry run's peak is within 5% of the measured one: it counts the gradients' all-reduce bucket from
    the backward's first gradient on, which is written into it (-11.4% when it was counted only from
    the concatenation on, ``lmfunc.dryrun.capture``). On ep 2 the measured peak lies between the dry
    run at an even share of the experts' rows and at the busiest rank's share (the study's
    invariant), and the even share is within 10% (-42% when the buffers of the exchanged rows, whose
    sizes are known only at run time, were counted as empty). On tp 2 + SP the dry run, its
    reduce-scatters lowered as on gloo (an all-to-all and a sum), is within 10%. On all three the
    dry run's collectives equal those rank 0's compiled step issued, kind by kind, in count and
    elements (the experts' exchange in count: its sizes are known only at run time)."""
    cases = run_quick("plan_accuracy", tmp_path, "--cases", ",".join(PLAN_ACCURACY_SEVERAL_RANKS))["cases"]
    assert set(cases) == set(PLAN_ACCURACY_SEVERAL_RANKS)
    assert all(abs(c["error"]) <= 0.15 and "dry_run_mib" in c for c in cases.values())
    assert all(c["collectives_equal"] for c in cases.values()), cases
    assert abs(cases["quick_cp2"]["dry_run_error"]) <= 0.05, cases["quick_cp2"]
    experts = cases["quick_moe_ep2"]
    assert experts["dry_run_mib"] <= experts["dry_run_at_measured_load_mib"] and abs(experts["dry_run_error"]) <= 0.10, experts
    assert abs(cases["quick_tp2_sp"]["dry_run_error"]) <= 0.10, cases["quick_tp2_sp"]


def test_a_plan_accuracy_case_that_the_config_lacks_is_named():
    from experiments.plan_accuracy.__main__ import main

    with pytest.raises(SystemExit, match=r"--cases quick_none,quick_tp8: quick.yaml has no case quick_tp8; its cases "
                                         r"are quick_none, quick_full"):
        main(["--quick", "--cases", "quick_none,quick_tp8"])


@pytest.mark.slow
def test_compile_depth_study_quick(tmp_path):
    summary = run_quick("compile_depth", tmp_path)
    assert set(summary["seconds"]) == {"unrolled L1", "scan L1", "unrolled L2", "scan L2"}
    measured = {(r["mode"], r["layers"]): r for r in json.loads((tmp_path / "results" / "measured.json").read_text())}
    for layers in (1, 2):
        assert measured[("scan", layers)]["first_loss"] == pytest.approx(measured[("unrolled", layers)]["first_loss"], rel=1e-5)
    assert (tmp_path / "compile_depth.png").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_scaling_study_quick(tmp_path):
    """The bucketed FSDP step's collectives per step, TP's all-reduces, each run's profile read, and
    the box's bound below the side-by-side pair's efficiency (it adds gloo's cost to the pair's
    step). The quick mode leaves out the runs whose counts tests/test_parallel.py asserts
    (``QUICK_LEAVES_OUT``: the per-leaf runs, DDP, HSDP, TP with SP). No assertion rests on how fast
    a run was, so it runs beside other tests."""
    from experiments.scaling.__main__ import QUICK_LEAVES_OUT

    summary = run_quick("scaling", tmp_path)
    rows, bound = summary["rows"], summary["bound"]
    assert not set(rows) & set(QUICK_LEAVES_OUT), sorted(rows)
    tp_collectives = {kind for kind, count in rows["tp2"]["collectives"].items() if count}
    assert tp_collectives == {"all_reduce"}, rows["tp2"]
    # tiny: embed, 2 blocks, head; the 2 blocks again in the backward (lmfunc.compiler.regather)
    assert rows["dp_shard2"]["collectives"]["all_gather_into_tensor"] == 6
    assert rows["single_pair"]["vs_side_by_side"] == 1 and "single_quad" not in rows
    assert all(row["step_ms"] > 0 for name, row in rows.items() if not name.startswith("single_"))
    assert rows["dp_shard2"]["collectives"]["all_to_all_single"] == 5  # gloo's reduce-scatters; the tied embedding's twice
    assert 0 < bound["gloo_fsdp_ms"] and 0 < bound["bound"] < bound["pair_efficiency"]


def test_a_folder_the_harness_did_not_write_is_never_deleted(tmp_path, monkeypatch):
    """``--out`` pointing at a folder with a user's ``runs/NAME`` (plain files, or a training run of
    the user's with its config.yaml and a NAME.out beside it): the study refuses and deletes
    nothing. A folder the harness marked as its own is replaced."""
    import subprocess

    from experiments.harness import HARNESS_MARK, Options, Run, run_training

    options = Options(quick=True, out=tmp_path, report_only=False, threads=1)
    mine = tmp_path / "runs" / "single"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("irreplaceable")
    (mine / "config.yaml").write_text("model: {}\n")
    (tmp_path / "runs" / "single.out").write_text("my notes")
    with pytest.raises(SystemExit, match=r"was not written by this harness .* Nothing was deleted"):
        run_training(Run("single"), tmp_path / "config.yaml", options)
    assert (mine / "thesis.tex").read_text() == "irreplaceable" and (mine / "config.yaml").exists()
    (mine / "thesis.tex").unlink()
    (mine / "config.yaml").unlink()
    mine.rmdir()
    with pytest.raises(SystemExit, match=r"single.out exists but was not written by this harness"):
        run_training(Run("single"), tmp_path / "config.yaml", options)
    assert (tmp_path / "runs" / "single.out").read_text() == "my notes"

    ran = []

    def fake_run(command, **kwargs):
        ran.append(command)
        assert sorted(p.name for p in mine.iterdir()) == [HARNESS_MARK]
        (mine / "log.jsonl").write_text("")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    (tmp_path / "runs" / "single.out").unlink()
    run_training(Run("single"), tmp_path / "config.yaml", options)
    (mine / "stale").write_text("from the first run")
    run_training(Run("single"), tmp_path / "config.yaml", options)
    assert not (mine / "stale").exists() and len(ran) == 2
