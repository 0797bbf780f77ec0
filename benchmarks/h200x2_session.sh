#!/usr/bin/env bash
# One device session on nvidia-h200-x2, each part detached (it outlives the command that starts it; poll
# from later commands, each sent right after the previous one returns). Run from the project root after
# the three bootstrap commands of ../shared/device/README.md.
#
#   bash benchmarks/h200x2_session.sh headline   GPU 1, alone: the 130K headline, vanilla then sgl_sparse
#                                                SnapKV 8192 (~20 min). Nothing else may use GPU 1 meanwhile:
#                                                a job beside it halves prefill (seen 2026-11-30).
#   bash benchmarks/h200x2_session.sh train      GPU 0: the quality models side by side, each for TRAIN_S
#                                                seconds (default 1150): the shipped small one on, for
#                                                vartrack; the large one on from LARGE_FROM (a carried
#                                                checkpoint dir; from scratch when unset).
#   bash benchmarks/h200x2_session.sh status     one line per part, the logs' tails; packs the logs into
#                                                $OUT/bench.tar.xz (so each poll brings them back).
#   bash benchmarks/h200x2_session.sh collect    packs results into $OUT as at most 8 files (the limit on
#                                                what comes back): logs and JSON, then the models' files.
# SPARSE_BATCH (default 28) sets ours' batch in the headline; HEADLINE_GPU (default 1) its GPU: 0 on a
# one-GPU machine (nvidia-h200), where nothing else may run beside it.
set -euo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
MODEL=.device-site/models/llama3-8b-shape
mkdir -p /root/bench /root/train

install() { python3 -m pip install -q --no-deps --no-build-isolation -e .; }
pack_logs() { (cd /root && tar cJf "$OUT/bench.tar.xz" bench train/*.txt); }

case "${1:-}" in
headline)
  install
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-1}" setsid nohup python3 benchmarks/decode_throughput.py --model-path $MODEL \
      --input-len 130000 --batch 6 --sparse-batch "${SPARSE_BATCH:-28}" --output-len 256 \
      --sparse-method snapkv --sparse-config '{"budget": 8192}' \
      --log-dir /root/bench/headline --json /root/bench/headline.json \
      > /root/bench/headline.txt 2>&1 < /dev/null &
  ;;
train)
  install
  large_init=()
  if [ -n "${LARGE_FROM:-}" ]; then
    cp -r "$LARGE_FROM" /root/train/large_init  # a carried path may not outlive the next command
    large_init=(--init-from /root/train/large_init --lr 6e-4)  # a fresh optimizer on trained weights
  fi
  CUDA_VISIBLE_DEVICES=0 setsid nohup python3 training/train.py --size large --out /root/train/large \
      "${large_init[@]}" --context 2048 --batch 32 --steps 40000 --workers 10 --eval-every 250 \
      --time-limit-s "${TRAIN_S:-1150}" > /root/train/large.txt 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=0 setsid nohup python3 training/train.py --size small --out /root/train/small \
      --init-from sgl_sparse/assets/quality-small --context 2048 --batch 32 --steps 40000 --lr 5e-4 \
      --workers 6 --eval-every 250 --task-weights vartrack=3 \
      --time-limit-s "${TRAIN_S:-1150}" > /root/train/small.txt 2>&1 < /dev/null &
  ;;
status)
  for name in decode_throughput.py "train.py --size large" "train.py --size small"; do
    echo "$name: $(pgrep -f "^python3 .*$name" >/dev/null && echo running || echo stopped)"
  done
  for f in /root/bench/headline/*.log; do
    [ -e "$f" ] && echo "$f: $(grep -E 'Prefill batch|Decode batch' "$f" | tail -n 1 | cut -c1-160)"
  done
  (tail -n 2 /root/bench/*.txt /root/train/*.txt 2>/dev/null || true) | cut -c1-300  # some may not exist yet
  # Every poll brings the logs back, so a machine lost later still leaves the last poll's results.
  if [ -n "${OUT:-}" ]; then pack_logs 2>/dev/null || true; fi
  ;;
collect)
  : "${OUT:?collect writes into \$OUT}"
  pack_logs
  for m in small large; do
    [ -e /root/train/$m/training_log.json ] || continue
    (cd /root/train && tar cf "$OUT/$m-meta.tar" $m/*.json)
    for f in /root/train/$m/*.safetensors; do cp "$f" "$OUT/$m-$(basename "$f")"; done
  done
  ls -la "$OUT"
  ;;
*)
  echo "usage: $0 headline|train|status|collect" >&2; exit 2 ;;
esac
