#!/usr/bin/env bash
# Step 1 of making the demo pair, on the GPU machine (device run, from the repository root):
# corpus, tokenizer, held-out prompts, then the target. What comes back under $OUT (at most 8
# files of 16 MiB): the target's safetensors shards and one tar of everything else.
set -euo pipefail
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/demo_data}
WORK=${WORK:-/tmp/demo}
rm -rf "$WORK" && mkdir -p "$WORK"
python3 training/corpus.py --out "$DATA" ${CORPUS_ARGS:-}
python3 training/tokenizer.py --data "$DATA" --out "$DATA/tokenizer"
python3 training/prompts.py --data "$DATA" --out "$WORK/demo_prompts.jsonl" ${PROMPTS_ARGS:-}
python3 training/train_target.py --data "$DATA" --tokenizer "$DATA/tokenizer" --out "$WORK/target" ${TARGET_ARGS:-}
cp "$DATA/manifest.json" "$WORK/"
mv "$WORK"/target/*.safetensors "$OUT/"
tar -C "$WORK" -cf "$OUT/target_rest.tar" .
ls -la "$OUT"
