#!/usr/bin/env bash
# The second bundled model (issue 44: attention shaped as a modern LLM's), in halves that run
# where they can:
#   scripts/second_model.sh prepare           here (no PyTorch needed): Debian's documentation,
#                                             manual pages and the GCIDE dictionary collected,
#                                             the tokenizer trained, both splits encoded into
#                                             build/strata-small-data (carry it to a GPU)
#   scripts/second_model.sh train OUT [MIN [FLAG...]]
#                                             where a GPU is (carry build/strata-small-data):
#                                             train the strata-small preset for MIN minutes
#                                             (default 8) on cuda, export to OUT in bf16; FLAGs
#                                             go to train_model.py (--bos-windows, --init DIR)
#   scripts/second_model.sh check DIR         here: the exported model loads in Strata and its
#                                             held-out perplexity is computed by strata ppl
# The exact commands land in the model card (DIR/README.md) and DIR/train_log.json.
set -euo pipefail
cd "$(dirname "$0")/.."
data=build/strata-small-data
python="${STRATA_TRAIN_PYTHON:-/usr/bin/python3}"
case "${1:-}" in
  prepare)
    "$python" tools/train_model.py --out "$data" --preset strata-small --prepare-only
    du -sh "$data"
    ;;
  train)
    out="${2:?train OUT [MINUTES]}"
    minutes="${3:-8}"
    shift $(($# < 3 ? $# : 3))
    [ -f "$data/data.json" ] || { echo "second_model.sh: no $data (run prepare here, carry it)" >&2; exit 2; }
    "$python" -c "import torch; assert torch.cuda.is_available(), 'no GPU'" ||
      { echo "second_model.sh: train wants PyTorch with a GPU (STRATA_TRAIN_PYTHON names its python)" >&2; exit 2; }
    "$python" tools/train_model.py --out "$out" --preset strata-small --data "$data" \
      --device cuda --minutes "$minutes" --dtype BF16 --batch 32 --lr 1.5e-3 \
      --long-seq-len 4096 --long-fraction 0.2 "$@"
    ;;
  check)
    dir="${2:?check DIR}"
    ./build/tools/strata ppl --model "$dir" --context 2048 --windows 4 "$dir/heldout.txt"
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
