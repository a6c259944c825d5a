"""The benchmark's workload: its model and a training step of each variant on one fixed batch.

Used by ``python -m experiments.bench`` (one process per variant) and its ``--paired`` mode (all
variants in one process, ``experiments.bench.paired``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from experiments.bench.config import BenchConfig


def model_config(bc: BenchConfig):
    """The benchmark's ``ModelConfig`` (Megatron-style GPT defaults at the chosen sizes)."""
    from lmfunc.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=bc.vocab, hidden_size=bc.hidden, num_layers=bc.layers, num_attention_heads=bc.heads,
        max_position_embeddings=bc.seq, recompute_granularity=bc.recompute, scan_layers=bc.scan_layers,
    )
    if bc.ce_chunk is not None:
        cfg = dataclasses.replace(cfg, cross_entropy_chunk_tokens=bc.ce_chunk)
    return cfg


COMPUTE_DTYPES = ("fp32", "bf16")


def compute_dtype(bc: BenchConfig):
    """The torch dtype of ``bc.dtype``; exits naming the flag when it is not one the bench runs."""
    import torch

    if bc.dtype not in COMPUTE_DTYPES:
        raise SystemExit(f"--dtype {bc.dtype!r}: the benchmark computes in {' or '.join(COMPUTE_DTYPES)}")
    return torch.bfloat16 if bc.dtype == "bf16" else torch.float32


def module_step(cfg, params, compiled: bool, dtype=None):
    """An idiomatic nn.Module training step with the same math and the same initial weights;
    with a low-precision ``dtype`` its forward runs under ``torch.autocast`` (fp32 weights)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from lmfunc.model import layers

    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            linear = lambda w: nn.Parameter(w.t().contiguous())  # noqa: E731  [in,out] -> nn.Linear [out,in]
            self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
            self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(1, 1, bias=False) for _ in range(4))
            self.w_gate, self.w_up, self.w_out = (nn.Linear(1, 1, bias=False) for _ in range(3))
            for name in ("wq", "wk", "wv", "wo"):
                getattr(self, name).weight = linear(p["attn"][name])
            for name in ("w_gate", "w_up", "w_out"):
                getattr(self, name).weight = linear(p["mlp"][name])

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(b, s, cfg.num_attention_heads, cfg.head_dim)
            k = self.wk(h).view(b, s, cfg.query_groups, cfg.head_dim)
            v = self.wv(h).view(b, s, cfg.query_groups, cfg.head_dim)
            q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
            h = self.mlp_norm(x)
            return x + self.w_out(F.silu(self.w_gate(h)) * self.w_up(h))

    class GPT(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed.weight = nn.Parameter(p["embed"]["tokens"].clone())
            self.blocks = nn.ModuleList(Block(p["layers"][str(i)]) for i in range(cfg.num_layers))
            self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)

        def forward(self, tokens, labels):
            cos, sin = layers.rope_tables(torch.arange(tokens.shape[1], device=tokens.device), cfg)
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, cos, sin)
            logits = self.final_norm(x) @ self.embed.weight.t()
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    # The weights are copied into the module and ``params`` is passed, not closed over, so the
    # caller's copy can be freed (a closure would keep it alive as long as the module class).
    model = GPT(params).to(params["embed"]["tokens"].device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    forward = torch.compile(model) if compiled else model
    optimizer_step = torch.compile(optimizer.step) if compiled else optimizer.step

    device_type = params["embed"]["tokens"].device.type
    autocast = dtype is not None and dtype != torch.float32

    def step(tokens, labels):
        with torch.autocast(device_type, dtype=dtype, enabled=autocast):
            loss = forward(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_step(bc: BenchConfig, variant: str) -> Callable[[], Any]:
    """One training step of ``variant`` on the benchmark's model and fixed batch, as a call that
    returns the step's loss tensor (every variant starts from the same weights)."""
    import torch

    from lmfunc import model
    from lmfunc.optim import adamw
    from lmfunc.train import TrainState, make_train_step

    device = torch.device(bc.device)
    cfg = model_config(bc)
    if variant == "func-scan":
        cfg = dataclasses.replace(cfg, scan_layers=True)
    params = model.init(cfg, seed=0, device=device)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, cfg.vocab_size, (bc.batch, bc.seq + 1), generator=g).to(device)
    tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    if variant.startswith("func"):
        tx = adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
        train_step = make_train_step(cfg, tx, clip_grad=1.0, compile=variant != "func-eager",
                                     donate_state=bc.donate, compute_dtype=compute_dtype(bc))
        holder = {"state": TrainState.create(params, tx)}
        batch = {"tokens": tokens[None], "labels": labels[None]}

        def step():
            holder["state"], metrics = train_step(holder["state"], batch)
            return metrics["loss"]

        return step
    if cfg.scan_layers:
        params = model.gpt.unstack_layers(params, cfg.num_layers)
    step = module_step(cfg, params, compiled=variant == "module-compiled", dtype=compute_dtype(bc))
    return lambda: step(tokens, labels)
