"""Small checkpoints for the engine tests: transformers' own DeepseekV3 as the target, a random
DFlash drafter beside it, and a character-level tokenizer whose 96 ids match the tiny vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.models import Drafter, DrafterConfig

from ..models.checkpoints import save_tiny, tiny_config

EOS = 0  # the tokenizer's <eos>; ids 1..95 are the printable ASCII characters


def drafter_config(vocab: int = 96, block_size: int = 4, layers=(0, 2)) -> dict:
    return dict(
        architectures=["DFlashDraftModel"], hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=vocab, dflash_config={"target_layer_ids": list(layers), "block_size": block_size,
                                         "mask_token_id": vocab - 1},
    )


def save_drafter(path: Path, raw: dict, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = Drafter(DrafterConfig.from_dict(raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(raw))


def save_char_tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS, **{chr(c): c - 31 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def make_pair(root: Path, *, vocab: int = 96, block_size: int = 4, tokenizer: bool = False, seed: int = 0, **target):
    """Write target/ (and its tokenizer) and drafter/ under root; returns (target_dir, drafter_dir, hf_model)."""
    target_dir, drafter_dir = root / "target", root / "drafter"
    hf = save_tiny(target_dir, tiny_config(vocab_size=vocab, **target), seed=seed)
    save_drafter(drafter_dir, drafter_config(vocab, block_size), seed=seed + 1)
    if tokenizer:
        save_char_tokenizer(target_dir)
    return target_dir, drafter_dir, hf


def prompts(count: int, vocab: int, seed: int, lengths=(3, 17)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in sizes]
