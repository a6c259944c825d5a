"""Text generation with a KV cache: ``generate(...)`` and ``python -m lmfunc.generate --run DIR``.

``generate`` is a pure function of its arguments (the randomness comes from ``seed``): the prompt
is run through the model once, filling the cache, then each new token costs one position.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence, Union

import torch
import tyro

from lmfunc import model
from lmfunc.config import ConfigError, ModelConfig
from lmfunc.model.gpt import Params
from lmfunc.model.kv_cache import forward_cached, init_cache


def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next-token ids ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0``; otherwise
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and to the smallest
    set whose probability reaches ``top_p`` (nucleus), then sampled with ``generator``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.to(torch.float32) / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p  # the mass before it already reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if generator is not None and generator.device != probs.device:  # a CPU generator: sample on the CPU
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_text(params: Params, cfg: ModelConfig, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> Optional[str]:
    """The text ``generate`` continues ``prompt`` with (temperature 0.8, top-k 40; the whole text,
    prompt included), at most ``max_new_tokens`` tokens within ``cfg.max_position_embeddings``;
    None when no token fits. An empty prompt starts from the tokenizer's end-of-document token."""
    ids = tokenizer.encode(prompt) or [tokenizer.eod]
    new_tokens = min(max_new_tokens, cfg.max_position_embeddings - len(ids))
    if new_tokens <= 0:
        return None
    return tokenizer.decode(generate(params, cfg, ids, new_tokens, temperature=0.8, top_k=40, seed=seed).tolist())


def _check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(
    params: Params,
    cfg: ModelConfig,
    prompt_tokens: Union[torch.Tensor, Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    max_seq_len: Optional[int] = None,
) -> torch.Tensor:
    """The prompt followed by ``max_new_tokens`` sampled tokens: ``[B, P + max_new_tokens]``
    (``[P + max_new_tokens]`` for a 1-D prompt).

    max_seq_len: the KV cache's length (default ``model.max_position_embeddings``); a prompt plus
        new tokens longer than it is an error, never a silent truncation.
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    prompt = torch.as_tensor(prompt_tokens, dtype=torch.int64)
    squeeze = prompt.dim() == 1
    prompt = prompt[None] if squeeze else prompt
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt_tokens must be a non-empty [P] or [B, P] sequence, got shape {tuple(prompt.shape)}")
    if int(prompt.min()) < 0 or int(prompt.max()) >= cfg.vocab_size:
        raise ValueError(f"prompt_tokens must be ids in [0, {cfg.vocab_size}), got [{int(prompt.min())}, {int(prompt.max())}]")
    capacity = cfg.max_position_embeddings if max_seq_len is None else max_seq_len
    total = prompt.shape[1] + max_new_tokens
    if total > capacity:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the KV cache's "
            f"max_seq_len ({capacity}); shorten the prompt, generate fewer tokens or raise max_seq_len"
        )
    weight = next(iter(params["embed"].values()))
    prompt = prompt.to(weight.device)
    cache = init_cache(cfg, prompt.shape[0], capacity, dtype=weight.dtype, device=weight.device)
    generator = torch.Generator().manual_seed(seed)
    hidden, cache = forward_cached(params, prompt, cfg, cache)
    out = [prompt]
    for i in range(max_new_tokens):
        next_token = sample_next(model.logits(params, hidden[:, -1], cfg), temperature, top_k, top_p, generator)
        out.append(next_token[:, None])
        if i + 1 < max_new_tokens:
            hidden, cache = forward_cached(params, next_token[:, None], cfg, cache)
    tokens = torch.cat(out, dim=1)
    return tokens[0] if squeeze else tokens


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample text from a trained run."""

    run: str
    """Run directory written by ``python -m lmfunc.train`` (holds config.yaml and model.safetensors)."""
    prompt: str = "The "
    """Text to continue."""
    max_new_tokens: int = 200
    """Tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0 is greedy."""
    top_k: Optional[int] = 40
    """Sample only among the k most likely tokens (None: all)."""
    top_p: Optional[float] = None
    """Nucleus sampling: the smallest set of tokens with this much probability (None: off)."""
    seed: int = 0
    """Sampling seed."""


def load_run(run_dir: str) -> tuple[ModelConfig, Params]:
    """The model config and trained parameters saved in ``run_dir``."""
    from lmfunc.checkpoint import load_weights
    from lmfunc.config.yaml_io import load_config

    config_path, weights_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            export = (f"; its checkpoints can give one: python -m lmfunc.export --checkpoint {run_dir} --out DIR, "
                      "then --run DIR" if os.path.isdir(os.path.join(run_dir, "checkpoints")) else "")
            raise ConfigError(
                f"{path} does not exist: --run must be a run directory of `python -m lmfunc.train` "
                f"that finished with checkpoint.save_weights on, or a folder written by lmfunc.export{export}"
            )
    cfg = load_config(config_path)
    return cfg.model, load_weights(weights_path, model.param_shapes(cfg.model))


def main(argv: Optional[Sequence[str]] = None) -> None:
    from lmfunc.data.tokenizer import ByteTokenizer

    args = tyro.cli(GenerateArgs, args=argv, prog="python -m lmfunc.generate")
    try:
        cfg, params = load_run(args.run)
        tokenizer = ByteTokenizer()
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise ConfigError("--prompt is empty; give the text to continue (e.g. --prompt 'The ')")
        if len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
            raise ConfigError(
                f"--prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
                f"context of {cfg.max_position_embeddings} tokens (model.max_position_embeddings of the run); "
                "shorten the prompt or lower --max-new-tokens"
            )
        tokens = generate(params, cfg, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(tokenizer.decode(tokens.tolist()))


if __name__ == "__main__":
    main()
