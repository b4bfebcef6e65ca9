"""Train the demo pair's byte-level BPE tokenizer on the training split, save it where
transformers' AutoTokenizer finds it, and encode both splits into token files.

    python -m training.tokenizer --data DATA --out TOKENIZER_DIR
    # TOKENIZER_DIR/tokenizer.json + tokenizer_config.json; DATA/train.npy, DATA/heldout.npy (uint16)

Documents are joined with the end-of-text token, which also ends each one; the mask token (the
drafter's) never occurs in text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from training.corpus import documents
from training.demo_config import EOT, EOT_ID, MASK, MASK_ID, VOCAB


def train_tokenizer(train_jsonl: Path, vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, MASK], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator((text for _, text in documents(train_jsonl)), trainer=trainer)
    if tok.token_to_id(EOT) != EOT_ID or tok.token_to_id(MASK) != MASK_ID:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    return tok


def save_for_transformers(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, mask_token=MASK,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    # transformers 5 names its own backend class here; the generic name loads in 4.x as well
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def encode_split(tok, jsonl: Path, batch: int = 512) -> np.ndarray:
    """Every document's ids followed by EOT, concatenated: uint16 [tokens]."""
    chunks, texts = [], []

    def flush():
        for enc in tok.encode_batch(texts):
            chunks.append(np.asarray(enc.ids + [EOT_ID], dtype=np.uint16))
        texts.clear()

    for _, text in documents(jsonl):
        texts.append(text)
        if len(texts) == batch:
            flush()
    flush()
    return np.concatenate(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="corpus.py's output directory")
    parser.add_argument("--out", type=Path, help="where tokenizer.json goes")
    parser.add_argument("--encode-only", type=Path, default=None,
                        help="a directory whose tokenizer.json encodes the splits (no training)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args()
    if args.encode_only is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.encode_only / "tokenizer.json"))
    elif args.out is None:
        parser.error("--out is required unless --encode-only is given")
    else:
        start = time.time()
        tok = train_tokenizer(args.data / "train.jsonl", args.vocab)
        save_for_transformers(tok, args.out)
        print(f"tokenizer: {tok.get_vocab_size()} tokens, trained in {time.time() - start:.0f} s")
    for split in ("train", "heldout"):
        ids = encode_split(tok, args.data / f"{split}.jsonl")
        np.save(args.data / f"{split}.npy", ids)
        size = (args.data / f"{split}.jsonl").stat().st_size
        print(f"{split}: {len(ids):,} tokens ({size / len(ids):.2f} bytes of JSON text per token)")


if __name__ == "__main__":
    main()
