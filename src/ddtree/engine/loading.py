"""What Engine.from_pretrained reads: the pair's weights, tokenizer and stop tokens; cache sizing."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..ops.policy import KernelPolicy
from ..parallel.shard import SINGLE, Shard
from .batch import PENDING_ROWS

KV_MEMORY_FRACTION = 0.85  # of the free memory after the weights: the rest is left to activations and graphs


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, device=None, dtype: torch.dtype | None = None,
              trust_remote_code: bool = False, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE):
    """(target, drafter or None, tokenizer or None, stop token ids) from Hugging Face directories.
    device defaults to CUDA when present; dtype to bf16 on CUDA, float32 on the CPU; policy: both
    models' kernel policy (ops/policy.py); shard: the part of the target this process holds
    (parallel/shard.py; the drafter is whole on every rank)."""
    from ..models import load_drafter, load_target

    device = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = load_target(target_dir, dtype=dtype, device=device, policy=policy, shard=shard)
    drafter = load_drafter(drafter_dir, target, policy=policy) if drafter_dir is not None else None
    tokenizer = load_tokenizer(target_dir, trust_remote_code)
    return target, drafter, tokenizer, stop_token_ids(target_dir, tokenizer)


def resolve_device(device=None) -> torch.device:
    """`device` (a torch.device or its name; None: CUDA when present, else the CPU), checked: a
    ValueError naming it when it is not a CUDA device or the CPU, or not on this machine."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device}: not a device (cuda, cuda:N or cpu)") from None
    if parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device}: ddtree runs on cuda or cpu")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this torch has no CUDA device (torch {torch.__version__}); use cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device}: there are {torch.cuda.device_count()} CUDA devices")
    return parsed


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """transformers' AutoTokenizer for a model directory, or None when it holds no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES) and not list(path.glob("tokenization_*.py")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def stop_token_ids(path: str | Path, tokenizer=None) -> tuple[int, ...]:
    """End-of-text ids: generation_config.json's eos_token_id, else config.json's (a multimodal
    wrapper's, else its text_config's), else the tokenizer's."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            raw = json.loads(file.read_text())
            eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()


def default_num_pages(target, page_size: int, max_pages_useful: int, device: torch.device,
                      memory_fraction: float = KV_MEMORY_FRACTION, cpu_bytes: int = 2 << 30) -> int:
    """Pages for the latent cache: at most what max_batch full-length requests can use; on CUDA,
    memory_fraction of the free memory (after weights), on the CPU at most cpu_bytes."""
    element = target.embed_tokens.weight.element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free, memory_fraction = cpu_bytes, 1.0
    return pages_that_fit(kv_page_bytes(target.cfg, page_size, element), free, max_pages_useful, memory_fraction)


def kv_page_bytes(cfg, page_size: int, element: int) -> int:
    """Bytes of one page of the latent cache over every layer (each rank holds it whole)."""
    return cfg.num_hidden_layers * page_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element


def pages_that_fit(page_bytes: int, free_bytes: int, max_pages_useful: int,
                   memory_fraction: float = KV_MEMORY_FRACTION) -> int:
    """KV pages in memory_fraction of free_bytes, at most max_pages_useful, at least 1 (one more
    page is the scratch page)."""
    return max(1, min(max_pages_useful, int(free_bytes * memory_fraction) // page_bytes - 1))


def drafter_capacity(max_model_len: int, prefill_chunk: int, max_depth: int) -> int:
    """Entries of each request's drafter context: a request's last round may commit D tokens past
    max_model_len - 1, and with overlap the round after it still drafts a block there before the
    host has seen it finish; a prefill chunk or the rows plain steps set aside may come on top."""
    return max_model_len + max(prefill_chunk, 2 * (max_depth + 1), max_depth + 1 + PENDING_ROWS)
