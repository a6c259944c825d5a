"""Worker for tests/test_megatron.py (torchrun, 2 ranks, gloo): megatron-core itself saves one
tiny dense model split over tensor parallelism 2, then another split over pipeline parallelism 2,
then an MoE model (with MLA and an MTP layer) split over expert parallelism 2 and over tensor
parallelism 2, each in both formats: ``torch_dist`` (``dist_checkpointing.save``) and the legacy one
(each rank's ``state_dict()`` as ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, as Megatron's
training loop writes it).

``python -m tests.megatron_worker OUT`` writes ``OUT/<split>_dist`` and ``OUT/<split>_legacy`` for
the splits ``tp2``, ``pp2``, ``ep2`` and ``tp2_moe``. The dense model is
``tests.test_megatron.split_config()``; with ``use_cpu_initialization`` megatron-core draws each whole
weight from the seeded CPU generator and keeps this rank's slice, so both layouts hold the same
model. megatron-core loads lmfunc's export ``OUT/export/release`` (written by the test) into its
model at TP 2, and rank 0 writes the logits of ``TOKENS`` gathered over the vocabulary split,
``OUT/tp2_export_logits.pt``. The MoE models hold lmfunc's MoE export ``OUT/export_moe/release``,
each rank loading its part.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from lmfunc.train.__main__ import exit_without_finalizing
from tests.megatron_oracle import megatron_gpt, megatron_logits, megatron_on_cpu


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
"""The batch whose logits megatron-core computes on lmfunc's export (vocabulary 128)."""


def save_both_formats(gpt, out: str, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> None:
    """``gpt`` (this rank's part) as a torch_dist save ``out + '_dist'`` and a legacy one ``out + '_legacy'``."""
    from megatron.core import dist_checkpointing

    os.makedirs(out + "_dist", exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(gpt.sharded_state_dict(), out + "_dist")
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    folder = os.path.join(out + "_legacy", "iter_0000005", name)
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": gpt.state_dict(), "iteration": 5, "checkpoint_version": 3.0},
               os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(out + "_legacy", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    dist.barrier()


def main(out: str) -> None:
    from megatron.core import parallel_state

    from tests.test_megatron import split_config

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = split_config()
    with megatron_on_cpu(tp=2, pp=1):
        torch.manual_seed(0)
        save_both_formats(megatron_gpt(cfg), os.path.join(out, "tp2"), rank, 0, 1)
    with megatron_on_cpu(tp=1, pp=2):
        torch.manual_seed(0)
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        save_both_formats(megatron_gpt(cfg, pre_process=first, post_process=last), os.path.join(out, "pp2"), 0, rank, 2)
    with megatron_on_cpu(tp=2, pp=1):
        from megatron.core import dist_checkpointing

        gpt = megatron_gpt(cfg)
        export = os.path.join(out, "export", "release")
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), export), strict=False)
        logits = megatron_logits(gpt, TOKENS).detach().contiguous()  # this rank's half of the vocabulary
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, logits)
        if rank == 0:
            torch.save(torch.cat(parts, dim=-1), os.path.join(out, "tp2_export_logits.pt"))
    with megatron_on_cpu(ep=2):
        from megatron.core import dist_checkpointing

        from tests.test_megatron import _config

        gpt = megatron_gpt(_config("deepseek"))
        export = os.path.join(out, "export_moe", "release")
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), export), strict=False)
        save_both_formats(gpt, os.path.join(out, "ep2"), 0, 0, 1, rank, 2)
    with megatron_on_cpu(tp=2):
        from megatron.core import dist_checkpointing

        gpt = megatron_gpt(_config("deepseek"))
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), export), strict=False)
        save_both_formats(gpt, os.path.join(out, "tp2_moe"), rank, 0, 1)
    print(f"rank {rank} ok")


if __name__ == "__main__":
    main(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()
