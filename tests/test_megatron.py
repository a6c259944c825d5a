"""Megatron-LM checkpoints (``lmfunc.checkpoint.megatron``), with megatron-core itself as the oracle
(``tests/megatron_oracle.py``): the fused layouts give Megatron's ``GPTModel`` lmfunc's logits and,
leaf by leaf, its gradients; a ``torch_dist`` save written by megatron-core imports, and lmfunc's
export loads back into megatron-core; Megatron's stored arguments must describe the model; bad
input gets one line that names the problem."""

import argparse
import dataclasses
import os
import re

import pytest
import torch

from lmfunc import model
from lmfunc.checkpoint.megatron import (
    ARGUMENTS_FILE, COMMON, load_megatron, read_torch_dist_model, save_megatron, write_torch_dist_model,
)
from lmfunc.checkpoint.megatron_layout import TE_NORM_NAMES, from_megatron_layers, to_megatron_layers
from lmfunc.checkpoint.megatron_legacy import FILE as LEGACY_FILE
from lmfunc.config.model import ConfigError, model_preset
from lmfunc.loss import lm_loss
from lmfunc.tree import flatten_with_paths, tree_leaves, tree_map, tree_unflatten_as
from tests.helpers import MLA_SETTINGS, MOE_SETTINGS
from tests.megatron_oracle import in_model_names, megatron_gpt, megatron_logits, megatron_on_cpu, megatron_token_losses

ARCHITECTURES = {
    "llama": dict(num_query_groups=2),
    "untied-mqa-qknorm": dict(tie_embeddings=False, num_query_groups=1, qk_layernorm=True),
    "gpt2": dict(normalization="LayerNorm", position_embedding_type="learned_absolute", add_bias_linear=True,
                 activation="gelu", num_query_groups=4),
    "deepseek": dict(MOE_SETTINGS, **MLA_SETTINGS, mtp_num_layers=1, tie_embeddings=False),
    "all-moe-mla-no-q-lora": dict(MOE_SETTINGS, moe_layer_freq=1, moe_router_score_function="softmax",
                                  moe_router_enable_expert_bias=False, moe_shared_expert_intermediate_size=None,
                                  **dict(MLA_SETTINGS, q_lora_rank=None)),
}
"""The architectures lmfunc trains: dense GQA/MQA/MHA, SwiGLU/GELU, RoPE/learned positions,
RMSNorm/LayerNorm, QK-norm, biases, tied and untied embeddings; DeepSeek-V3's kind (a dense then an
MoE layer with sigmoid routing, the expert bias, a shared expert and both router losses, MLA with a
query latent, an MTP layer); every layer MoE with softmax routing and MLA without a query latent."""


def split_config():
    """The model megatron-core saves split over TP 2 and PP 2 (``tests/megatron_worker.py``): 4
    layers, 2 query groups (one per TP rank), SwiGLU, untied embeddings (with tied ones split over
    pipeline stages, megatron-core moves the shared table to CUDA for its all-reduce)."""
    return model_preset("tiny", vocab_size=128, num_layers=4, num_query_groups=2, tie_embeddings=False)


def _config(name: str):
    return model_preset("tiny", vocab_size=128, num_layers=2, **ARCHITECTURES[name])


def _params(cfg, seed: int = 0):
    """Initial params with every leaf moved off its init (norm scales off 1, biases off 0), so a
    swapped or transposed tensor shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    return tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g), model.init(cfg, seed=seed))


def _logits(params, cfg, tokens):
    return model.logits(params, model.forward(params, tokens, cfg), cfg)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_megatrons_model_on_mapped_weights_gives_lmfuncs_losses_and_gradients(name):
    """lmfunc's params in Megatron's layout (local spec) make megatron-core's ``GPTModel`` compute
    the same per-token losses (1e-5) and MTP loss, and its backward of the same objective (the mean
    loss, with MTP's and the routers' losses attached as Megatron attaches them) the same gradient
    for every tensor, mapped by the same layout: a transposed square matrix, a swapped gate and up
    projection or MLA's RoPE dims in the wrong order would show here."""
    cfg = _config(name)
    params = _params(cfg)
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 16), generator=g),
             "labels": torch.randint(0, cfg.vocab_size, (2, 16), generator=g),
             "loss_mask": (torch.rand(2, 16, generator=g) > 0.2).float()}
    leaves = [leaf.clone().requires_grad_(leaf.is_floating_point()) for _, leaf in flatten_with_paths(params)]
    out = lm_loss(tree_unflatten_as(params, leaves), batch, cfg, grad_scale=torch.tensor(1.0),
                  calculate_per_token_loss=False)
    (out.loss_sum / out.num_tokens).backward()
    our_grads = tree_unflatten_as(params, [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves])
    ours = model.logits(params, model.forward(params, batch["tokens"], cfg), cfg)
    with megatron_on_cpu():
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()
        gpt = megatron_gpt(cfg)
        result = gpt.load_state_dict(in_model_names(to_megatron_layers(params, cfg, spelling="local"), gpt), strict=False)
        assert not [k for k in result.missing_keys if not k.endswith("_extra_state")] and not result.unexpected_keys
        causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
        per_token = gpt(batch["tokens"], torch.arange(16).expand(2, 16), causal, labels=batch["labels"],
                        loss_mask=batch["loss_mask"])
        ((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
        their_grads = {key: p.grad for key, p in gpt.named_parameters()}
        tracker = MTPLossLoggingHelper.tracker
        mtp_losses = tracker.get("values", tracker.get("loss_values"))  # megatron-core 0.16, 0.19
    expected = torch.nn.functional.cross_entropy(ours.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    assert (per_token.detach().flatten() - expected).abs().max() < 1e-5
    if cfg.mtp_num_layers:
        assert torch.allclose(mtp_losses, (out.mtp_loss_sums / out.mtp_num_tokens).detach(), rtol=1e-5)
    mapped = in_model_names(to_megatron_layers(our_grads, cfg, spelling="local"), gpt)
    buffers = {key for key in mapped if key.endswith("router.expert_bias")}  # updated without a gradient
    assert mapped.keys() - buffers == their_grads.keys()
    for key in their_grads:
        scale = float(their_grads[key].abs().max())
        assert scale > 0 and float((mapped[key] - their_grads[key]).abs().max()) <= 1e-5 * max(scale, 1.0), key


def test_both_spellings_and_a_scan_model_map_back_exactly():
    """TE's fused norm names read as the local spec's; layers stack for ``scan_layers``."""
    cfg = _config("gpt2")
    params = _params(cfg)
    local = to_megatron_layers(params, cfg, spelling="local")
    te = to_megatron_layers(params, cfg, spelling="te")
    assert "decoder.layers.1.input_layernorm.bias" in local and "decoder.layers.1." + TE_NORM_NAMES[
        "input_layernorm.bias"] in te
    for tensors in (local, te):
        back = from_megatron_layers(tensors, cfg, "test")
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(back), flatten_with_paths(params)))
        storages = [leaf.untyped_storage().data_ptr() for _, leaf in flatten_with_paths(back)]
        assert len(set(storages)) == len(storages)  # a donating step updates each leaf in place
    scan = dataclasses.replace(cfg, scan_layers=True)
    stacked = from_megatron_layers(te, scan, "test")
    assert stacked["layers"]["attn"]["wq"].shape[0] == cfg.num_layers
    assert to_megatron_layers(stacked, scan).keys() == te.keys()


@pytest.mark.parametrize("name", ["llama", "deepseek", "all-moe-mla-no-q-lora"])
def test_a_torch_dist_save_of_megatron_core_imports_and_lmfuncs_export_loads_back(name, tmp_path):
    """megatron-core's ``dist_checkpointing.save`` of its model imports to params with its logits;
    ``save_megatron`` of other params loads into a fresh megatron-core model through
    ``dist_checkpointing.load`` (the ``_extra_state`` objects included), with lmfunc's logits: layers
    stacked (dense, every layer MoE) or one by one (dense and MoE layers mixed), experts stacked."""
    from megatron.core import dist_checkpointing

    cfg = _config(name)
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, cfg.vocab_size, (2, 2, 16), generator=g)

    def token_losses(params):
        logits = _logits(params, cfg, tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 16)

    saved = tmp_path / "megatron_save"
    saved.mkdir()
    with megatron_on_cpu():
        gpt = megatron_gpt(cfg)
        dist_checkpointing.save(gpt.sharded_state_dict(), str(saved))
        expected = megatron_token_losses(gpt, tokens, labels).detach()
        imported = load_megatron(str(saved), cfg)
        assert imported.format == "torch_dist" and imported.iteration is None and imported.args is None
        assert (token_losses(imported.params) - expected).abs().max() < 1e-5

        params = _params(cfg, seed=5)
        out = tmp_path / "export"
        directory = save_megatron(params, cfg, str(out))
        assert directory == str(out / "release") and (out / "latest_checkpointed_iteration.txt").read_text() == "release"
        fresh = megatron_gpt(cfg)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), directory), strict=False)
        assert (megatron_token_losses(fresh, tokens, labels) - token_losses(params)).abs().max() < 1e-5
    arguments = (out / ARGUMENTS_FILE).read_text()
    assert "--swiglu" in arguments and "--disable-bias-linear" in arguments
    assert ("--num-query-groups 2" in arguments) == (name == "llama")
    assert ("--moe-layer-freq '[0,1]'" in arguments) == (name == "deepseek")


def test_a_megatron_save_replaces_another_only_when_told(tmp_path):
    """``save_megatron`` into a folder that holds a save: refused with the folder and the way out,
    nothing changed; a Megatron run's folder whose tracker names its own save is refused too (the
    write would point the run's resume at the export). With ``overwrite`` the save is replaced,
    a larger save's extra shard files removed, and what is loaded is the new save."""
    cfg = _config("llama")
    out = tmp_path / "export"
    save_megatron(_params(cfg, seed=1), cfg, str(out))
    stale = out / "release" / "__7_0.distcp"
    stale.write_bytes(b"a shard of a save on 8 ranks")
    with pytest.raises(ConfigError, match=rf"{out}/release holds \d+ files .* pass overwrite=True"):
        save_megatron(_params(cfg, seed=2), cfg, str(out))
    assert stale.exists()
    save_megatron(_params(cfg, seed=2), cfg, str(out), overwrite=True)
    assert not stale.exists()
    loaded = load_megatron(str(out), cfg).params
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(loaded), tree_leaves(_params(cfg, seed=2))))

    run = tmp_path / "megatron_run"
    write_torch_dist_model(to_megatron_layers(_params(cfg), cfg), str(run), 30)
    with pytest.raises(ConfigError, match=r"latest_checkpointed_iteration.txt names the save '30'"):
        save_megatron(_params(cfg), cfg, str(run))
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "30" and not (run / "release").exists()


def test_stored_megatron_arguments_must_describe_the_model(tmp_path):
    """With Megatron's ``args`` in ``common.pt``: a differing setting is named with the flag to
    pass; a setting lmfunc cannot express is refused by name; a matching one imports, with the
    iteration."""
    cfg = _config("llama")
    args = argparse.Namespace(num_layers=2, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                              group_query_attention=True, num_query_groups=2, kv_channels=cfg.head_dim,
                              ffn_hidden_size=cfg.ffn_size, max_position_embeddings=cfg.max_position_embeddings,
                              position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                              add_bias_linear=False, untie_embeddings_and_output_weights=False, padded_vocab_size=128,
                              rotary_base=10000, rotary_percent=1.0, norm_epsilon=cfg.norm_epsilon,
                              init_method_std=cfg.init_method_std)
    tensors = to_megatron_layers(_params(cfg), cfg)
    write_torch_dist_model(tensors, str(tmp_path), 40, {"args": args, "iteration": 40})
    loaded = load_megatron(str(tmp_path), cfg)
    assert loaded.iteration == 40 and loaded.directory.endswith("iter_0000040")
    with pytest.raises(ConfigError, match=r"num_query_groups is 2 there, 4 here.*pass --model.num-query-groups 2"):
        load_megatron(str(tmp_path), dataclasses.replace(cfg, num_query_groups=4))
    args.rotary_interleaved = True
    write_torch_dist_model(tensors, str(tmp_path), 40, {"args": args, "iteration": 40}, overwrite=True)
    with pytest.raises(ConfigError, match=r"cannot express: rotary_interleaved=True: interleaved RoPE"):
        load_megatron(str(tmp_path), cfg)


def _parsed(arguments: list[str]) -> argparse.Namespace:
    """Megatron-LM's ``args`` of ``megatron_arguments``' flags, as its parser names them (dashes to
    underscores; a flag without a value is True; a quoted list is a list; numbers are numbers)."""
    import ast
    import shlex

    words = shlex.split(" ".join(a for a in arguments if not a.startswith("#")))
    args = argparse.Namespace(padded_vocab_size=128)
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
            if isinstance(value, str):
                try:
                    value = ast.literal_eval(value)
                except (ValueError, SyntaxError):
                    pass
            setattr(args, word[2:].replace("-", "_"), value)
    args.untie_embeddings_and_output_weights = "--untie-embeddings-and-output-weights" in words
    args.add_bias_linear = "--disable-bias-linear" not in words
    args.swiglu = "--swiglu" in words
    args.group_query_attention = "--group-query-attention" in words
    return args


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_printed_megatron_arguments_describe_the_model_and_unmapped_settings_are_refused(name):
    """``megatron_arguments(cfg)``, read back as Megatron's ``args``, describe ``cfg`` exactly (MoE,
    MLA and MTP included); Megatron settings lmfunc lacks are refused by name."""
    from lmfunc.checkpoint.megatron_args import megatron_arguments, mismatches, model_settings

    cfg = _config(name)
    args = _parsed(megatron_arguments(cfg))
    assert mismatches(model_settings(args, "test"), cfg) == {}
    if cfg.multi_latent_attention:
        with pytest.raises(ConfigError, match=r"rope_type='yarn': lmfunc's MLA rotates with plain RoPE"):
            model_settings(argparse.Namespace(**{**vars(args), "rope_type": "yarn"}), "test")
    if cfg.num_experts:
        with pytest.raises(ConfigError, match=r"moe_shared_expert_gate=True: a gated shared expert"):
            model_settings(argparse.Namespace(**{**vars(args), "moe_shared_expert_gate": True}), "test")
        with pytest.raises(ConfigError, match=r"'sinkhorn': lmfunc has 'aux_loss', 'seq_aux_loss' and 'none'"):
            model_settings(argparse.Namespace(**{**vars(args), "moe_router_load_balancing_type": "sinkhorn"}), "test")
        pattern = [int(moe) for moe in cfg.moe_layers]  # the same layers, spelled as a list
        for freq, differs in ((pattern, False), ([1 - moe for moe in pattern], True)):
            other = model_settings(argparse.Namespace(**{**vars(args), "moe_layer_freq": freq}), "test")
            assert ("moe_layer_freq" in mismatches(other, cfg)) == differs, freq


def spelled_name(spelled: dict, local: dict, te_grouped: dict) -> str:
    return "local" if spelled is local else "te_grouped" if spelled is te_grouped else "grouped"


def expert_parallel_part(state: dict, rank: int, ranks: int, cfg) -> dict:
    """What expert-parallel rank ``rank`` of ``ranks`` holds of a whole legacy ``state``, as Megatron
    writes it: its ``E / ranks`` routed experts numbered from 0 (each spelling), the rest whole."""
    local = cfg.num_experts // ranks
    mine = range(rank * local, (rank + 1) * local)
    part = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.experts\.)(?:local_experts\.(\d+)(\..+)|(linear_fc[12]\.weight)(\d+))", name)
        if match and int(match.group(2) or match.group(5)) in mine:
            index = int(match.group(2) or match.group(5)) - rank * local
            part[f"{match.group(1)}local_experts.{index}{match.group(3)}" if match.group(2)
                 else f"{match.group(1)}{match.group(4)}{index}"] = tensor
        elif match:
            continue
        elif name.endswith(".experts.weight1"):  # [h, E 2f] viewing [E, h, 2f]
            part[name] = tensor.view(cfg.num_experts, cfg.hidden_size, -1)[mine].reshape(cfg.hidden_size, -1)
        elif name.endswith(".experts.weight2"):  # [E f, h]
            part[name] = tensor.view(cfg.num_experts, -1, cfg.hidden_size)[mine].reshape(-1, cfg.hidden_size)
        else:
            part[name] = tensor
    return part


def test_a_legacy_moe_save_imports_from_each_expert_spelling(tmp_path):
    """A legacy save's module state dict holds the routed experts one by one: the sequential
    experts' ``local_experts.<e>.linear_fc1.weight``, TE's grouped ``linear_fc1.weight<e>`` or the
    legacy grouped GEMM's ``weight1``/``weight2``; each imports to the same params, whole and split
    over 2 expert-parallel ranks."""
    cfg = _config("deepseek")
    params = _params(cfg)
    local = to_megatron_layers(params, cfg, spelling="local")
    te_grouped = {re.sub(r"local_experts\.(\d+)\.(linear_fc[12])\.weight", r"\2.weight\1", k): v for k, v in local.items()}
    grouped = {k: v for k, v in local.items() if "local_experts" not in k}
    stacked = to_megatron_layers(params, cfg, spelling="te")
    for prefix in ("decoder.layers.1.mlp.experts.", "mtp.layers.0.transformer_layer.mlp.experts."):
        fc1, fc2 = stacked[prefix + "experts.linear_fc1.weight"], stacked[prefix + "experts.linear_fc2.weight"]
        grouped[prefix + "weight1"] = fc1.transpose(1, 2).contiguous().view(cfg.hidden_size, -1)  # [E, h, 2f] as [h, E 2f]
        grouped[prefix + "weight2"] = fc2.transpose(1, 2).contiguous().view(-1, cfg.hidden_size)  # [E, f, h] as [E f, h]
    for spelled in (local, te_grouped, grouped):
        back = from_megatron_layers(spelled, cfg, "test")
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(back), flatten_with_paths(params)))
        # The same save split over 2 expert-parallel ranks (mp_rank_00_000, mp_rank_00_001), each rank
        # numbering its 2 experts from 0, merges back to the same params.
        for rank in range(2):
            folder = tmp_path / spelled_name(spelled, local, te_grouped) / "iter_0000001" / f"mp_rank_00_{rank:03d}"
            folder.mkdir(parents=True)
            torch.save({"model": expert_parallel_part(spelled, rank, 2, cfg), "iteration": 1}, folder / LEGACY_FILE)
        (folder.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
        back = load_megatron(str(folder.parent.parent), cfg).params
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(back), flatten_with_paths(params)))
    del local["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    with pytest.raises(ConfigError, match=r"holds experts \[0, 1, 2\] of .*expert-parallel save's other ranks"):
        from_megatron_layers(local, cfg, "test")


class _NotPlainData:
    """A class beyond plain data, which a pickle would have to construct (and so could run code)."""


def test_a_save_of_megatron_core_0_19_keeps_its_common_state_in_the_checkpoint_files(tmp_path):
    """megatron-core 0.19 writes no ``common.pt``: the common state (``args``, ``iteration``, the
    optimizer's unsharded state) is one pickled object, ``common_state/shard_0_1``, in the
    ``torch.distributed.checkpoint`` files, and ``metadata.json`` names no common backend (as
    megatron-core 0.19.2 writes it; checked by hand, since that version needs Python 3.12 and
    triton). The iteration, the loss scaler and the weights are read, the pickle with
    ``weights_only``: the same save holding another class is refused."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from lmfunc.checkpoint.megatron import megatron_run_state
    from lmfunc.checkpoint.megatron_optimizer import read_megatron_loss_scale

    cfg = _config("llama")
    params = _params(cfg)
    scaler = {"scale": torch.tensor([4096.0]), "growth_tracker": 3, "hysteresis_tracker": 1}
    common = {"iteration": 7, "checkpoint_version": 3.0, "optimizer": {"optimizer": {"param_groups": []}, "grad_scaler": scaler}}
    for name, stored in (("plain", common), ("foreign", dict(common, extra=_NotPlainData()))):
        directory = tmp_path / name / "iter_0000007"
        # megatron-core's ShardedObject: a bytes item holding [data], not flattened
        dcp.save({**to_megatron_layers(params, cfg), "common_state/shard_0_1": [stored]}, checkpoint_id=str(directory),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
        (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
        (directory.parent / "latest_checkpointed_iteration.txt").write_text("7")
    iteration, args, _ = megatron_run_state(str(tmp_path / "plain"))
    assert iteration == 7 and args is None
    assert read_megatron_loss_scale(str(tmp_path / "plain")) == (4096.0, 3, 1)
    loaded = load_megatron(str(tmp_path / "plain"), cfg)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(loaded.params), flatten_with_paths(params)))
    with pytest.raises(ConfigError, match=r"common_state/shard_0_1\) holds objects beyond plain data and Megatron's args"):
        megatron_run_state(str(tmp_path / "foreign"))


def test_a_legacy_rank_name_with_two_numbers_is_a_pipeline_or_an_expert_parallel_rank_as_megatron_says():
    """``mp_rank_00_001`` is pipeline rank 1 or expert-parallel rank 1: Megatron's args decide, and
    without them the state dicts' keys do (expert-parallel ranks hold the same keys)."""
    from lmfunc.checkpoint.megatron_legacy import _rank_layout

    def files(args, keys):
        return {(0, rank): (f"mp_rank_00_{rank:03d}", {"args": args, "model": dict.fromkeys(names)})
                for rank, names in enumerate(keys)}

    same, stages = [["a", "b"], ["a", "b"]], [["embedding", "a"], ["a", "output_layer"]]
    expert = argparse.Namespace(expert_model_parallel_size=2, pipeline_model_parallel_size=1)
    pipeline = argparse.Namespace(expert_model_parallel_size=1, pipeline_model_parallel_size=2)
    assert set(_rank_layout("d", files(None, same))) == {(0, 0, 0), (0, 0, 1)}
    assert set(_rank_layout("d", files(None, stages))) == {(0, 0, 0), (0, 1, 0)}
    assert set(_rank_layout("d", files(expert, stages))) == {(0, 0, 0), (0, 0, 1)}
    assert set(_rank_layout("d", files(pipeline, same))) == {(0, 0, 0), (0, 1, 0)}


def test_bad_checkpoints_get_one_line_that_names_the_problem(tmp_path):
    """A truncated shard, a save without ``common.pt``, one without metadata, a shape the model does
    not have, an architecture not mapped, and a legacy pickle that needs a class beyond plain data."""
    cfg = _config("llama")
    directory = write_torch_dist_model(to_megatron_layers(_params(cfg), cfg), str(tmp_path / "save"), 3)
    shard = next(p for p in sorted(os.listdir(directory)) if p.endswith(".distcp"))
    with open(os.path.join(directory, shard), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"a shard file is missing or truncated"):
        load_megatron(str(tmp_path / "save"), cfg)
    os.remove(os.path.join(directory, COMMON))
    with pytest.raises(ConfigError, match=r"common.pt is missing, and the checkpoint files hold no common_state/shard_0_1 either"):
        load_megatron(directory, cfg)
    os.remove(os.path.join(directory, "metadata.json"))
    with pytest.raises(ConfigError, match=r"holds neither metadata.json \(torch_dist\) nor mp_rank_\*/"):
        load_megatron(directory, cfg)
    wide = tmp_path / "wide"
    write_torch_dist_model(to_megatron_layers(_params(cfg), cfg), str(wide))
    bigger = dataclasses.replace(cfg, ffn_hidden_size=2 * cfg.ffn_size)
    with pytest.raises(ConfigError, match=r"decoder.layers.0.mlp.linear_fc1.weight has shape \(256, 64\).*implies \(512, 64\)"):
        load_megatron(str(wide), bigger)
    moe = model_preset("tiny", vocab_size=128, num_layers=2, num_query_groups=2, num_experts=4)
    with pytest.raises(ConfigError, match=r"no tensor decoder.layers.0.mlp.router.weight .*--model.num-experts"):
        load_megatron(str(wide), moe)
    deepseek = _config("deepseek")
    save_megatron(_params(deepseek), deepseek, str(tmp_path / "deepseek"))
    with pytest.raises(ConfigError, match=r"holds 19 tensor\(s\) the model config has no place for, first "
                                          r"mtp.layers.0.*--model.mtp-num-layers"):
        load_megatron(str(tmp_path / "deepseek"), dataclasses.replace(deepseek, mtp_num_layers=0))
    with pytest.raises(ConfigError, match=r"no layout for MoE with GELU"):
        load_megatron(str(wide), model_preset("tiny", num_experts=4, activation="gelu"))
    legacy = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"model": {}, "args": _Unlisted()}, legacy / LEGACY_FILE)
    with pytest.raises(ConfigError, match=r"needs the class tests.test_megatron._Unlisted to load.*weights_only=True"):
        load_megatron(str(tmp_path / "legacy"), cfg)


class _Unlisted:
    """A class a legacy checkpoint might pickle: loading it would run code, so it is refused."""


def test_a_legacy_save_imports_with_its_arguments_and_iteration(tmp_path):
    """A legacy ``mp_rank_00/model_optim_rng.pt`` (Megatron's model state dict, its args, the
    iteration) imports to the same params."""
    cfg = _config("untied-mqa-qknorm")
    params = _params(cfg)
    folder = tmp_path / "iter_0000007" / "mp_rank_00"
    folder.mkdir(parents=True)
    args = argparse.Namespace(num_layers=2, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                              group_query_attention=True, num_query_groups=1, swiglu=True, add_bias_linear=False,
                              qk_layernorm=True, untie_embeddings_and_output_weights=True, padded_vocab_size=128,
                              position_embedding_type="rope", normalization="RMSNorm")
    torch.save({"model": to_megatron_layers(params, cfg, spelling="local"), "args": args, "iteration": 7,
                "checkpoint_version": 3.0}, folder / LEGACY_FILE)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    loaded = load_megatron(str(tmp_path), cfg)
    assert loaded.format == "torch" and loaded.iteration == 7
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(loaded.params), flatten_with_paths(params)))


def test_training_starts_from_megatron_weights_and_exports_them_back(tmp_path, capsys):
    """``--checkpoint.load-megatron``: a run at learning rate 1e-30 ends with the imported weights;
    ``python -m lmfunc.export --format megatron`` of that run writes them back unchanged. Given to
    ``--checkpoint.load`` instead, the Megatron save is refused with the flag to use."""
    from lmfunc.checkpoint import load_weights
    from lmfunc.export import main as export_main
    from lmfunc.train.__main__ import main as train_main

    cfg = model_preset("tiny", vocab_size=384)
    params = _params(cfg)
    write_torch_dist_model(to_megatron_layers(params, cfg), str(tmp_path / "megatron"), 100)
    common = ["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--run.train-iters", "1",
              "--optim.lr", "1e-30", "--optim.min-lr", "0", "--optim.lr-warmup-iters", "0", "--run.eval-iters", "0",
              "--run.no-compile", "--log.no-progress-bar", "--run.micro-batch-size", "2", "--run.global-batch-size", "2",
              "--run.sample-tokens", "0", "--log.peak-flops", "1e11", "--run.out-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        train_main(common + ["--run.name", "wrong", "--checkpoint.load", str(tmp_path / "megatron")])
    assert f"pass --checkpoint.load-megatron {tmp_path / 'megatron'} instead" in capsys.readouterr().err
    train_main(common + ["--run.name", "r", "--checkpoint.load-megatron", str(tmp_path / "megatron")])
    trained = load_weights(str(tmp_path / "r" / "model.safetensors"), params)
    assert all(torch.equal(trained_leaf, leaf) for (_, trained_leaf), (_, leaf)
               in zip(flatten_with_paths(trained), flatten_with_paths(params)))
    export_main(["--checkpoint", str(tmp_path / "r"), "--out", str(tmp_path / "back"), "--format", "megatron"])
    back = read_torch_dist_model(str(tmp_path / "back" / "release"))
    assert all(torch.equal(back[key], tensor) for key, tensor in to_megatron_layers(params, cfg).items())
    assert (tmp_path / "back" / "release" / COMMON).exists()


def test_megatrons_own_tp2_pp2_and_ep2_saves_import_to_one_model(tmp_path, torchrun):
    """megatron-core on 2 ranks saves a model split over TP 2, one split over PP 2, and an MoE model
    (MLA, an MTP layer) split over EP 2 and over TP 2, each as torch_dist and legacy
    (``tests/megatron_worker.py``). The legacy import, which merges the column- and row-parallel
    slices (MLA's projections, the shared and routed experts, MTP's projection included), the SwiGLU
    halves, the stages' layer numbers and the expert-parallel ranks' experts itself, gives the
    params of megatron-core's own torch_dist save of the same ranks; the TP 2 model (drawn whole,
    then sliced) has the logits of megatron-core's unsplit model of the same seed; lmfunc's export,
    loaded by megatron-core at TP 2, gives lmfunc's logits; and the MoE models, which loaded lmfunc's
    MoE export, save the exported params exactly in both formats."""
    cfg, moe = split_config(), _config("deepseek")
    exported, exported_moe = _params(cfg, seed=7), _params(moe, seed=8)
    save_megatron(exported, cfg, str(tmp_path / "export"))
    save_megatron(exported_moe, moe, str(tmp_path / "export_moe"))
    torchrun(2, ["-m", "tests.megatron_worker", str(tmp_path)])
    for split, model_cfg in (("tp2", cfg), ("pp2", cfg), ("ep2", moe), ("tp2_moe", moe)):
        merged, stored = (load_megatron(str(tmp_path / f"{split}_{kind}"), model_cfg) for kind in ("legacy", "dist"))
        assert merged.format == "torch" and stored.format == "torch_dist"
        reference = dict(flatten_with_paths(stored.params))
        for path, leaf in flatten_with_paths(merged.params):
            assert torch.equal(leaf, reference[path]), (split, path)
        if model_cfg is moe:  # the model that loaded lmfunc's export
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(stored.params),
                                                                   flatten_with_paths(exported_moe))), split
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with megatron_on_cpu():
        torch.manual_seed(0)
        expected = megatron_logits(megatron_gpt(cfg), tokens).detach()
    tp2 = load_megatron(str(tmp_path / "tp2_legacy"), cfg).params
    assert (_logits(tp2, cfg, tokens) - expected).abs().max() < 1e-5
    from tests.megatron_worker import TOKENS

    tp2_logits = torch.load(tmp_path / "tp2_export_logits.pt")
    assert (tp2_logits - _logits(exported, cfg, TOKENS)).abs().max() < 1e-5


def test_a_megatron_training_save_continues_at_its_iteration_with_megatrons_lr(tmp_path, capsys):
    """A Megatron training save (``iter_0000030``, ``args`` with its schedule and 120 consumed
    samples): the lmfunc run starts at step 31 with the data at sample 120, and its first update's
    lr is megatron-core's ``OptimizerParamScheduler`` at iteration 30 (its steps counted in samples,
    as Megatron's training loop counts them). Another lr, or lmfunc's default per-token loss
    normalisation where Megatron ran its default per-microbatch means, is refused with the flags to pass;
    ``--checkpoint.finetune`` takes the weights alone and starts at step 1. An fp16 run continues
    with Megatron's loss scale and trackers, and other scaler settings are refused with the flag."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from lmfunc.train.__main__ import main as train_main
    from lmfunc.train.log import read_log

    cfg = model_preset("tiny", vocab_size=384)
    args = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        group_query_attention=True, num_query_groups=cfg.query_groups, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=False, padded_vocab_size=384, position_embedding_type="rope",
        normalization="RMSNorm", lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=5,
        lr_decay_iters=None, lr_warmup_fraction=None, lr_warmup_init=0.0, train_iters=32, global_batch_size=4,
        consumed_train_samples=120, train_samples=None)
    write_torch_dist_model(to_megatron_layers(_params(cfg), cfg), str(tmp_path / "megatron"), 30,
                           {"args": args, "iteration": 30, "checkpoint_version": 3.0})
    common = ["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--run.train-iters", "32",
              "--optim.min-lr", "3e-4", "--optim.lr-warmup-iters", "5", "--run.eval-iters", "0", "--run.no-compile",
              "--log.no-progress-bar", "--log.log-interval", "1", "--run.micro-batch-size", "2",
              "--run.global-batch-size", "4", "--run.sample-tokens", "0", "--log.peak-flops", "1e11",
              "--run.out-dir", str(tmp_path), "--checkpoint.load-megatron", str(tmp_path / "megatron")]
    with pytest.raises(SystemExit):
        train_main(common + ["--run.name", "other_lr", "--optim.lr", "1e-3"])
    assert ("lr is 0.003 there, 0.001 here; calculate_per_token_loss is False there, True here. To continue it, pass "
            "--optim.lr 0.003 --run.no-calculate-per-token-loss") in capsys.readouterr().err
    common.append("--run.no-calculate-per-token-loss")  # Megatron's default loss normalisation
    train_main(common + ["--run.name", "finetuned", "--optim.lr", "1e-3", "--checkpoint.finetune"])
    assert [r["step"] for r in read_log(str(tmp_path / "finetuned" / "log.jsonl")) if r["kind"] == "train"][0] == 1
    capsys.readouterr()
    train_main(common + ["--run.name", "continued", "--optim.lr", "3e-3"])
    assert "at iteration 30 (120 samples consumed; fresh Adam moments: the save holds no optimizer state" in capsys.readouterr().out
    records = read_log(str(tmp_path / "continued" / "log.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [31, 32]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=5 * 4,
                                        lr_decay_steps=32 * 4, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=32 * 4, wd_incr_style="constant")
    scheduler.step(30 * 4)
    assert train[0]["lr"] == pytest.approx(scheduler.get_lr(optimizer.param_groups[0]), rel=1e-6)
    assert records[-1]["kind"] == "end" and records[-1]["consumed_samples"] == 120 + 2 * 4

    # An fp16 run continues with Megatron's dynamic loss scaler (its state as the mixed-precision
    # optimizer writes it to common.pt: read from megatron-core's own save in the test below), once
    # the scaler's settings are Megatron's.
    scaler = {"scale": torch.tensor([32768.0]), "growth_tracker": 1, "hysteresis_tracker": 2}
    fp16_args = argparse.Namespace(**vars(args), fp16=True, loss_scale=None, loss_scale_window=2, hysteresis=2,
                                   min_loss_scale=1.0)
    write_torch_dist_model(to_megatron_layers(_params(cfg), cfg), str(tmp_path / "megatron_fp16"), 30,
                           {"args": fp16_args, "iteration": 30, "checkpoint_version": 3.0,
                            "optimizer": {"optimizer": {"param_groups": []}, "grad_scaler": scaler}})
    fp16 = [arg if arg != str(tmp_path / "megatron") else str(tmp_path / "megatron_fp16") for arg in common]
    fp16 += ["--optim.lr", "3e-3", "--precision.compute-dtype", "fp16"]
    with pytest.raises(SystemExit):
        train_main(fp16 + ["--run.name", "fp16_other_window"])
    assert "loss_scale_window is 2 there, 1000 here. To continue it, pass --precision.loss-scale-window 2" in capsys.readouterr().err
    train_main(fp16 + ["--run.name", "fp16", "--precision.loss-scale-window", "2"])
    assert "; Megatron's loss scale 32768 (growth tracker 1, hysteresis tracker 2))" in capsys.readouterr().out
    train = [r for r in read_log(str(tmp_path / "fp16" / "log.jsonl")) if r["kind"] == "train"]
    # Step 31 is the second clean step of Megatron's growth interval of 2: the scale doubles (a fresh
    # scaler would log its 2^32), and step 32 starts the next interval.
    assert [(r["step"], r["loss_scale"]) for r in train] == [(31, 65536.0), (32, 65536.0)]


@pytest.mark.parametrize("name,dtype,optimizer_kind", [
    ("llama", "fp32", "plain"), ("deepseek", "fp32", "plain"), ("llama", "fp16", "plain"), ("llama", "bf16", "plain"),
    ("llama", "fp32", "distributed"), ("llama", "bf16", "distributed")])
def test_a_megatron_save_with_adam_state_continues_with_megatrons_next_update(name, dtype, optimizer_kind, tmp_path):
    """megatron-core trains three steps with its Adam and saves model and optimizer (torch_dist, the
    optimizer's per-parameter moments; the distributed optimizer's ``fully_reshardable`` format): in
    fp32, or in fp16 (its dynamic loss scaler growing the scale every 2 clean steps) or bf16 with
    fp32 master weights. lmfunc reads the moments, the step count (one level down in the
    mixed-precision optimizer's common state, in the distributed one's param groups), the master
    weights and the scaler's state, and takes step 4 on the same batch: its params (the master
    weights) equal Megatron's after its own step 4, and its loss scale is the one Megatron's scaler
    reaches. With fresh moments and a fresh scaler the same step lands elsewhere, so the state read
    is what makes them equal."""
    from megatron.core import dist_checkpointing

    from lmfunc.checkpoint.megatron_optimizer import load_megatron_adam, read_megatron_loss_scale
    from lmfunc.optim import adamw
    from lmfunc.precision import LossScaleConfig
    from lmfunc.train import TrainState, make_train_step
    from lmfunc.train.from_megatron import with_megatron_adam, with_megatron_loss_scale
    from tests.megatron_oracle import fp32_master_weights, megatron_adam, megatron_optimizer_on_cpu

    cfg = _config(name)
    if cfg.num_experts:  # Megatron-LM's finalize_model_grads updates the expert bias; this hand-made step does not
        cfg = dataclasses.replace(cfg, moe_router_enable_expert_bias=False)
    compute = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    scaling = dict(initial_loss_scale=2.0**14, loss_scale_window=2, hysteresis=2, min_loss_scale=1.0)
    hyper = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(7)
    batches = [{"tokens": torch.randint(0, cfg.vocab_size, (1, 2, 16), generator=g),
                "labels": torch.randint(0, cfg.vocab_size, (1, 2, 16), generator=g),
                "loss_mask": (torch.rand(1, 2, 16, generator=g) > 0.2).float()} for _ in range(4)]
    with megatron_on_cpu(), megatron_optimizer_on_cpu():
        gpt = megatron_gpt(cfg)
        ddp, optimizer = megatron_adam(gpt, **hyper, dtype=compute, distributed=optimizer_kind == "distributed",
                                       **(scaling if dtype == "fp16" else {}))

        def megatron_step(batch):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            mask = batch["loss_mask"][0]
            per_token = megatron_token_losses(ddp, batch["tokens"][0], batch["labels"][0], mask)
            ((per_token * mask).sum() / mask.sum() * optimizer.get_loss_scale()).backward()
            ddp.finish_grad_sync()
            assert optimizer.step()[0]

        for batch in batches[:3]:
            megatron_step(batch)
        save = tmp_path / "megatron" / "iter_0000003"
        save.mkdir(parents=True)
        model = gpt.sharded_state_dict()
        # Megatron-LM's --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}
        dist_checkpointing.save({"model": model, "optimizer": optimizer.sharded_state_dict(model, metadata=metadata),
                                 "iteration": 3, "checkpoint_version": 3.0}, str(save))
        (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("3")
        if optimizer_kind == "distributed":  # Megatron-LM's default format, whose flattened buffers are not read
            default = tmp_path / "default" / "iter_0000003"
            default.mkdir(parents=True)
            model = gpt.sharded_state_dict()
            dist_checkpointing.save({"model": model, "optimizer": optimizer.sharded_state_dict(
                model, metadata={"distrib_optim_sharding_type": "dp_reshardable"}), "iteration": 3}, str(default))
            unread = load_megatron_adam(str(default), cfg)
            assert not unread.read and "save with --dist-ckpt-optim-fully-reshardable" in unread.format
        megatron_step(batches[3])
        expected = fp32_master_weights(gpt, optimizer)
        expected_scale = float(optimizer.get_loss_scale())
    path = str(tmp_path / "megatron")
    adam = load_megatron_adam(path, cfg)
    assert adam.read and adam.count == 3 and adam.format == "model-space moments"
    assert (adam.master_weights is None) == (dtype == "fp32" and optimizer_kind == "plain")
    saved_scale = read_megatron_loss_scale(path)
    loss_scale = None
    if dtype == "fp16":  # grown at step 2, one clean step since
        assert saved_scale == (2.0**15, 1, 2)
        loss_scale = LossScaleConfig(initial_scale=scaling["initial_loss_scale"], min_scale=1.0, growth_interval=2,
                                     hysteresis=2)
    else:
        assert saved_scale is None
    tx = adamw(hyper["lr"], b1=hyper["betas"][0], b2=hyper["betas"][1], eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    step = make_train_step(cfg, tx, clip_grad=0.0, compile=False, calculate_per_token_loss=False,  # Megatron's default
                           compute_dtype=compute, loss_scale=loss_scale)
    fresh = TrainState.create(load_megatron(path, cfg).params, tx, loss_scale=loss_scale)
    continued = with_megatron_adam(fresh, adam)
    if saved_scale is not None:
        continued = with_megatron_loss_scale(continued, saved_scale)
    errors, scales = {}, {}
    for label, state in (("continued", continued), ("fresh", fresh)):
        state, _ = step(state, batches[3])
        ours = in_model_names(to_megatron_layers(state.params, cfg, spelling="local"), gpt)
        errors[label] = max(float((ours[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)
        scales[label] = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
    # In 16 bits the two models' forwards round differently (fused and split projections): measured
    # 1.2e-4 (fp16) and 8.4e-4 (bf16), within half the format's epsilon, which is the bound.
    bound = 1e-6 if dtype == "fp32" else torch.finfo(compute).eps / 2
    assert errors["continued"] < bound and errors["fresh"] > 1e-2, errors
    assert scales["continued"] == expected_scale and (dtype != "fp16" or scales["fresh"] != expected_scale), scales


def test_adams_step_count_is_read_from_the_plain_or_the_distributed_optimizers_common_state():
    """``common.pt`` holds the plain optimizer's ``common_step`` (as megatron-core writes it above), or
    the distributed optimizer's param groups' ``step`` (its ``state_dict``; writing one needs CUDA),
    for one optimizer or a chain of them; a save without either gives none."""
    from lmfunc.checkpoint.megatron_optimizer import _common_step

    plain = {"state": {"common_step": torch.tensor(2.0)}, "param_groups": [{"lr": 1e-3}]}
    distributed = {"optimizer": {"param_groups": [{"lr": 1e-3, "step": 5}, {"lr": 1e-3, "step": 5}]}}
    assert _common_step({"optimizer": plain}) == 2 and _common_step({"optimizer": distributed}) == 5
    assert _common_step({"optimizer": {0: distributed, 1: distributed}}) == 5 and _common_step({"optimizer": [plain]}) == 2
    assert _common_step({"args": None}) is None
