#!/usr/bin/env bash
# Step 2 of making the demo pair, on the GPU machine: the drafter on the committed target
# (src/ddtree/demo/target), then the report (benchmarks/demo_pair.py) on the complete pair.
# The corpus is rebuilt and encoded with the target's tokenizer when this machine lacks it.
set -euo pipefail
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/demo_data}
WORK=${WORK:-/tmp/demo}
PAIR=src/ddtree/demo
if [ ! -f "$DATA/train.npy" ]; then
  python3 training/corpus.py --out "$DATA" ${CORPUS_ARGS:-}
  python3 training/tokenizer.py --data "$DATA" --encode-only "$PAIR/target"
fi
rm -rf "$WORK/drafter"
python3 training/train_drafter.py --target "$PAIR/target" --data "$DATA" --out "$WORK/drafter" ${DRAFTER_ARGS:-}
rm -rf "$PAIR/drafter" && cp -r "$WORK/drafter" "$PAIR/drafter"
cp "$WORK"/drafter/*.safetensors "$OUT/"
cp "$WORK"/drafter_log.json "$WORK"/drafter_loss.png "$WORK"/drafter/config.json "$OUT/"
mv "$OUT/config.json" "$OUT/drafter_config.json"
python3 benchmarks/demo_pair.py --heldout "$DATA/heldout.jsonl" --out-dir "$WORK/results" ${REPORT_ARGS:-}
tar -C "$WORK/results" -cf "$OUT/report.tar" .
ls -la "$OUT"
