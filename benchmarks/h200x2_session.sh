#!/usr/bin/env bash
# One device session on nvidia-h200-x2, everything detached (it outlives this command; poll /root/bench
# from later commands, each sent right after the previous one returns). Run from the project root after
# the three bootstrap commands of ../shared/device/README.md. Logs and JSON land in /root/bench.
#   GPU 1: the 130K headline, vanilla then sgl_sparse SnapKV 8192, one after the other (~21 min).
#   GPU 0: the SnapKV scoring kernel check, the agent workload (vanilla vs dense), then training (the large
#          quality model from scratch at 2K context, and the shipped small one on, for vartrack; side by side).
# SPARSE_BATCH (default 24) sets ours' batch; TRAIN_S (default 480) bounds the training.
set -euo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e .
mkdir -p /root/bench /root/train
MODEL=.device-site/models/llama3-8b-shape
GPU_FLAGS="--load-format dummy --mem-fraction-static 0.80 --context-length 131072 --sampling-backend pytorch \
--disable-piecewise-cuda-graph --chunked-prefill-size 16384 --cuda-graph-max-bs 32"

CUDA_VISIBLE_DEVICES=1 setsid nohup python3 benchmarks/decode_throughput.py --model-path $MODEL \
    --input-len 130000 --batch 6 --sparse-batch "${SPARSE_BATCH:-24}" --output-len 256 \
    --sparse-method snapkv --sparse-config '{"budget": 8192}' \
    --log-dir /root/bench/headline --json /root/bench/headline.json > /root/bench/headline.txt 2>&1 < /dev/null &

CUDA_VISIBLE_DEVICES=0 setsid nohup bash -c "
  python3 benchmarks/window_scores_kernel.py > /root/bench/window_scores.txt 2>&1
  python3 -m bench_agent generate --config bench_agent/configs/swe_agent_h200.toml --out /root/bench/agent.jsonl
  python3 -m bench_agent compare --model-path $MODEL --trace /root/bench/agent.jsonl --time-scale 0.5 \
      --out /root/bench/agent --server-args='$GPU_FLAGS' > /root/bench/agent.txt 2>&1
  python3 training/train.py --size large --out /root/train/large --context 2048 --batch 32 --steps 30000 \
      --workers 10 --eval-every 250 --time-limit-s ${TRAIN_S:-480} > /root/train/large.txt 2>&1 &
  python3 training/train.py --size small --out /root/train/small --init-from sgl_sparse/assets/quality-small \
      --context 2048 --batch 32 --steps 20000 --lr 5e-4 --workers 6 --eval-every 250 --task-weights vartrack=3 \
      --time-limit-s ${TRAIN_S:-480} > /root/train/small.txt 2>&1 &
  wait
" > /root/bench/gpu0.txt 2>&1 < /dev/null &
sleep 5
echo "started; poll: tail -3 /root/bench/*.txt /root/train/*.txt"
