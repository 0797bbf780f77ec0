#!/usr/bin/env bash
# One device session (nvidia-h200 or nvidia-h200-x2), each part detached: it outlives the command that
# starts it; poll from later commands, each sent right after the previous one returns (the machine is
# released 30 s after a command ends, and detached work dies with it). Run from the project root after
# the bootstrap commands (tools/device/device_site_parts.sh; tools/device/README.md lists them). The 130K
# steps' batches below are an H200's; on an H100 each default is scaled to its pool (VANILLA_BATCH: 3 there).
#
#   bash tools/device/device_session.sh headline   the 130K headline on GPU HEADLINE_GPU (default 1 on a
#                                                two-GPU machine, else 0): vanilla, then sgl_sparse SnapKV 8192 at
#                                                SPARSE_BATCH (default 28) requests, ~24 min. Nothing else
#                                                may use that GPU meanwhile: a job beside it halves prefill.
#   bash tools/device/device_session.sh vanilla130k | dense130k | snapkv130k | snapkv130k6 | table130k
#                                                the headline one server per step (vanilla x 6, ours dense
#                                                x 6, SnapKV 8192 x SPARSE_BATCH, default 60, and x 6), so one
#                                                vanilla run serves every comparison; table130k prints the table.
#   bash tools/device/device_session.sh quest130k | omnikv130k | retroinfer130k   Quest / OmniKV / RetroInfer (default config) at 130K x
#                                                SELECT_BATCH (default 5 for Quest and RetroInfer, what their pools
#                                                fit, 6 for OmniKV), ours
#                                                only (table130k adds them). quest130k6 | retroinfer130k6: at 6, with
#                                                --mem-fraction-static SELECT_MEM (default 0.85) for ours: the memory
#                                                their metadata adds, said beside the figure. On a fresh machine the first server of
#                                                each compiles FlashInfer kernels for its wrappers (minutes).
#   bash tools/device/device_session.sh fp8kv130k | fp8kv130k6 | kivi130k | kivi130k6 | turboquant130k | turboquant130k6
#                                                fp8_kv / kivi (4-bit) / turboquant (4-bit) at 130K x QUANT_BATCH
#                                                (default 11 / 19 / 22, what their 1.94x / 3.2x / 3.76x pools fit)
#                                                and x 6, ours only (table130k adds them). QUANT_CONFIG: the
#                                                method's --sparse-config (default {}), QUANT_TAG: a suffix for
#                                                its files, e.g. QUANT_CONFIG='{"prefix_attention": "dequantize"}'
#                                                QUANT_TAG=dequant.
#   bash tools/device/device_session.sh vanilla32k | quest32k | omnikv32k | retroinfer32k | table32k
#                                                32,768 in x 16: vanilla FlashInfer, then each selection method at its
#                                                default config, one server a step; table32k prints them together.
#   bash tools/device/device_session.sh evict130k   EVICT_METHODS (default h2o rkv skipkv kvzip pyramidkv) at 130K x EVICT_BATCH (6), default
#                                                configs, ours only, one server each, decode CUDA graphs on
#                                                (EVICT_SERVER_ARGS: more server flags). Run it
#                                                through `queue` (its servers then start one after another).
#   bash tools/device/device_session.sh palu130k | palu130k6   Palu (rank ratio PALU_RATIO, default 0.5) at 130K x PALU_BATCH
#                                                (default 2 x vanilla's batch: its 1.996x pool) and x 6, ours only (table130k
#                                                adds them); PALU_SERVER_ARGS: flags for ours (default --mem-fraction-static
#                                                0.81: at 0.80 six 130K requests miss 440 slots); PALU_TILE: the decode
#                                                kernel's tile (Palu's decode_tile). paludiag: its decode steps profiled.
#   bash tools/device/device_session.sh snapkvfp8130k  SnapKV 8192 over the FP8 pool (snapkv+fp8_kv) at 130K x COMPOSE_BATCH
#                                                (default 24), ours only; SPARSE_BATCH=24 snapkv130k is SnapKV alone
#                                                at the same batch (each ~6 min of prefill).
#   bash tools/device/device_session.sh quantdecode  benchmarks/quant_decode.py: KIVI 4/2-bit, FP8, TurboQuant decode
#                                                kernels per layer at 6 x 130K and 16 x 32K against their HBM floor
#                                                (QUANT_WARPS, QUANT_ARGS: tile sweeps, e.g. --kivi-pages 2 4).
#   bash tools/device/device_session.sh ncudecode  ncu (stall reasons, scheduler, memory, occupancy) of the first
#                                                decode kernel launch matching NCU_KERNEL under quant_decode.py QUANT_ARGS.
#   bash tools/device/device_session.sh quantprefill  benchmarks/quant_prefill.py: one layer of a 16K chunk's attention over a
#                                                quantized 114K prefix (FP8's kernel at several tiles, KIVI-4,
#                                                TurboQuant-4, FP8 dequantized + FlashInfer) beside FlashInfer bf16
#                                                (QUANT_PREFILL_ARGS), ~2 min.
#   bash tools/device/device_session.sh selection   benchmarks/selection_overhead.py: Quest's, OmniKV's and RetroInfer's
#                                                selection cost per layer, stage by stage (SELECTION_ARGS: e.g.
#                                                --tables retroinfer --shapes 5x130000 16x32768).
#   bash tools/device/device_session.sh streamingllm  StreamingLLM (default config) at 130K x STREAM_BATCH (default
#                                                24), ours only, on HEADLINE_GPU (the vanilla row: headline's).
#   bash tools/device/device_session.sh floorref   vanilla at 8,448 in x FLOOR_BATCH (default 60): what vanilla
#                                                reaches at SnapKV 8,192's per-request KV (its % of the floor).
#   bash tools/device/device_session.sh questdiag  profiled Quest decode steps (32,768 in x QDIAG_BATCH, default 5); summary in
#                                                /root/bench/questdiag-profile.txt (~3 min).
#   bash tools/device/device_session.sh diag       profiled decode steps, ours (SnapKV 8192 on 16K prompts) and vanilla
#                                                (8,448) x DIAG_BATCH (52), same live KV; summaries in
#                                                /root/bench/diag-profile.txt (~6 min: run it as `queue diag`,
#                                                it runs in the foreground otherwise).
#   bash tools/device/device_session.sh layout     benchmarks/attention_layout.py: FlashInfer decode over contiguous,
#                                                SnapKV-like and random slot layouts (LAYOUT_BATCH, default 60).
#   bash tools/device/device_session.sh agent      bench_agent compare on bench_agent/configs/agent_overflow_h200
#                                                .toml: vanilla FlashInfer, then AGENT_METHODS (METHOD or
#                                                METHOD:CONFIG_JSON, no spaces; default snapkv:{"budget":8192} dense,
#                                                AGENT_DENSE=0: without dense); each replay ~6 min, a summary per
#                                                run as it ends. e.g. AGENT_METHODS="quest omnikv". AGENT_PRUNE_LAG=N:
#                                                each method also replayed in pruning mode (tool results but the N
#                                                most recent pruned after each turn), labelled NAME+prune; AGENT_PRUNE_ONLY=1: only in pruning mode.
#   bash tools/device/device_session.sh gputests   python3 -m pytest tests/gpu -v (test_gpu_eviction.py alone took ~9 min on
#                                                a fresh machine, JIT included); GPU_TESTS="tests/gpu/a.py tests/gpu/b.py"
#                                                runs only those.
#   bash tools/device/device_session.sh gpukernels  the kernel-level tests of GPU_TESTS only (no servers), ~2 min.
#   bash tools/device/device_session.sh quality16k quality-large at 16K: dense, snapkv 2048 and 4096, streamingllm.
#   bash tools/device/device_session.sh quality16ksel | quality16kquant | quality16kevict   quality-large at 16K for the
#                                                selection methods (quest, omnikv, retroinfer) / the quantized pools
#                                                (fp8_kv, kivi 4 and 2 bits, turboquant) / h2o, rkv, skipkv (not kvzip: no replay
#                                                room at 16K), default configs, each ~1 min a method. QUALITY_SERVER_ARGS:
#                                                more server flags for `quality`.
#   bash tools/device/device_session.sh plan1 | plan2 | plan3 | plan4 | plan5   the benchmark plan, one session's GPU
#                                                time each (~25 min at most), most important first, as a queue: plan1
#                                                the eviction methods at 130K x 6 (evict130k), plan2 Palu (palu130k,
#                                                palu130k6) and every decode kernel (quantdecode), plan3 the quantized
#                                                pools at their largest batch, plan4 selection at 130K, plan5 selection
#                                                at 32K x 16. Each starts with vanilla130k unless this machine has it.
#   bash tools/device/device_session.sh rows       BENCHMARKS.md rows (benchmarks/bench_rows.py) of every result on
#                                                this machine against its vanilla: /root/bench/rows130k.md, rows32k.md.
#   bash tools/device/device_session.sh queue STEP...  the steps above one after another in one detached job
#                                                (e.g. `queue gputests headline floorref`); its progress
#                                                and each step's failure, if any, in /root/bench/queue.txt.
#   bash tools/device/device_session.sh train      the quality models side by side, each for TRAIN_S seconds
#                                                (default 1150): large on LARGE_GPU from LARGE_FROM (a
#                                                carried model dir; from scratch when unset) at
#                                                LARGE_CONTEXT (default 2048; past 2048 it draws prompts
#                                                from LARGE_MIN_CONTEXT, default 1024; LARGE_TASK_WEIGHTS
#                                                and LARGE_LR override its task mix and learning rate);
#                                                small on SMALL_GPU from
#                                                SMALL_FROM (default: the shipped one) at 2048. GPUs
#                                                default to 0. TRAIN_MODELS="large" trains one only.
#                                                Every TASK_EVAL_EVERY steps (default 2000) each logs
#                                                held-out exact match per task and saves its weights;
#                                                STOP_AT=1.0 stops one once every task reaches it.
#   bash tools/device/device_session.sh quality DIR TOKENS...
#                                                the suite through our server on GPU QUALITY_GPU (default
#                                                0): QUALITY_METHODS (default dense), n=QUALITY_N (50), each
#                                                size; /root/bench/quality-NAME[-QUALITY_TAG].*
#   bash tools/device/device_session.sh status     one line per part, the logs' tails; packs the logs into
#                                                $OUT/bench.tar.xz (so each poll brings them back).
#   bash tools/device/device_session.sh collect    packs results into $OUT as at most 8 files (the limit on
#                                                what comes back): logs and JSON, then the models' files.
#   bash tools/device/device_session.sh wait [S]   waits up to S seconds (default 560) for training to end;
#                                                then collect if it has ended (so the weights come back in
#                                                this same command: the machine may be gone by the next
#                                                one), else status.
set -euo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
MODEL=.device-site/models/llama3-8b-shape
# GPU 1 on a two-GPU machine (GPU 0 trains or runs quality beside it), else GPU 0.
DEFAULT_GPU=$([ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ] && echo 1 || echo 0)
mkdir -p /root/bench /root/train
# Vanilla's batch at 130K: 6 on an H200 (141 GB), 3 on an H100 (80 GB). Every 130K step's default batch (a
# method's largest, and the "...6" steps' "at vanilla's batch") is the H200's scaled by VB / 6; the *_BATCH
# variables below override a step's outright.
VB=${VANILLA_BATCH:-$([ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null || echo 0)" -gt 100000 ] && echo 6 || echo 3)}
scaled() { echo $(( $1 * VB / 6 )); }

install() { python3 -m pip install -q --no-deps --no-build-isolation -e .; }
# launch LOG CMD...: detached (one part per command), or in the foreground inside a queue.
# Beside each part, the GPU's temperatures, clocks, power and throttle reasons every 10 s (LOG-gpu.csv):
# a long prefill heats the GPU before the decode window is measured.
GPU_QUERY=timestamp,index,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active
launch() {
  local log=$1; shift
  if [ -n "${FOREGROUND:-}" ]; then
    nvidia-smi --query-gpu=$GPU_QUERY --format=csv -l 10 > "${log%.txt}-gpu.csv" 2>&1 & local smi=$!
    "$@" > "$log" 2>&1 < /dev/null || echo "$(date +%T) rc=$? from $*" >> /root/bench/queue.txt
    kill $smi 2>/dev/null || true
  else
    setsid nohup timeout 3600 nvidia-smi --query-gpu=$GPU_QUERY --format=csv -l 10 > "${log%.txt}-gpu.csv" 2>&1 < /dev/null &
    setsid nohup "$@" > "$log" 2>&1 < /dev/null &
  fi
}
# Profiler traces stay on the machine (their summaries come back in the logs).
pack_logs() { (cd /root && tar cJf "$OUT/bench.tar.xz" --exclude='*.trace.json.gz' bench train/*.txt); }
palu_config() {  # Palu's --sparse-config from PALU_RATIO and PALU_TILE
  echo "{\"rank_ratio\": ${PALU_RATIO:-0.5}${PALU_TILE:+, \"decode_tile\": \"$PALU_TILE\"}}"
}

case "${1:-}" in
headline)
  install
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/headline.txt python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "${SPARSE_BATCH:-$(scaled 28)}" --output-len 256 \
      --sparse-method snapkv --sparse-config '{"budget": 8192}' \
      --log-dir /root/bench/headline --json /root/bench/headline.json
  ;;
vanilla130k|dense130k|snapkv130k|snapkv130k6)  # the 130K table one server per step: vanilla x 6, ours dense x 6,
  install           # SnapKV 8192 x SPARSE_BATCH (default 60) and x 6 (vanilla's batch); `table130k` prints them together
  case "$1" in
  vanilla130k) only=(--only vanilla) batch="$VB" cfg=(--sparse-method dense) ;;
  dense130k) only=(--only sgl_sparse) batch="$VB" cfg=(--sparse-method dense --sparse-config '{}') ;;
  snapkv130k) only=(--only sgl_sparse) batch="${SPARSE_BATCH:-$(scaled 60)}" cfg=(--sparse-method snapkv --sparse-config '{"budget": 8192}') ;;
  snapkv130k6) only=(--only sgl_sparse) batch="$VB" cfg=(--sparse-method snapkv --sparse-config '{"budget": 8192}') ;;
  esac
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$1.txt" python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$batch" --output-len 256 "${only[@]}" "${cfg[@]}" \
      --log-dir "/root/bench/$1" --json "/root/bench/$1.json"
  ;;
quest130k|omnikv130k|retroinfer130k)  # Quest / OmniKV (2,048-token budget) / RetroInfer (default configs) at 130K x 6, ours
  install                # only (all three passed their GPU tests: no opt-in needed since 2026-12-03)
  m=${1%130k}
  # Quest's page summaries (1/16 of K+V) leave a pool of 744,944 slots, RetroInfer's index 738,800: 5 x 130K
  # fit, not 6 (2026-12-03); OmniKV keeps vanilla's 788,603.
  b="${SELECT_BATCH:-$([ "$m" = omnikv ] && echo "$VB" || scaled 5)}"
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$1.txt" \
      python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$b" \
      --output-len 256 --only sgl_sparse --sparse-method "$m" --sparse-config '{}' \
      --log-dir "/root/bench/$1" --json "/root/bench/$1.json"
  ;;
quest130k6|retroinfer130k6)  # Quest / RetroInfer at vanilla's batch, 6 x 130K: their metadata (Quest 7,680 bytes a token
  install                    # beside the KV's 131,072) needs --mem-fraction-static 0.834 where vanilla's 6 fit in
  m=${1%130k6}               # 0.80, so ours gets SELECT_MEM (default 0.85; vanilla at 0.85 still fits 6, not 7)
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$1.txt" \
      python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$VB" \
      --output-len 256 --only sgl_sparse --sparse-method "$m" --sparse-config '{}' \
      --sparse-server-args "--mem-fraction-static ${SELECT_MEM:-0.85}" \
      --log-dir "/root/bench/$1" --json "/root/bench/$1.json"
  ;;
vanilla32k|quest32k|omnikv32k|retroinfer32k)  # the selection issue's second shape: 32,768 in x 16, 256 out, one server
  install                                      # a step (vanilla FlashInfer or ours at the method's default config)
  m=${1%32k}
  if [ "$m" = vanilla ]; then only=(--only vanilla); cfg=(--sparse-method dense); else
    only=(--only sgl_sparse); cfg=(--sparse-method "$m" --sparse-config '{}'); fi
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$1.txt" \
      python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 32768 --batch 16 --sparse-batch 16 \
      --output-len 256 "${only[@]}" "${cfg[@]}" --log-dir "/root/bench/$1" --json "/root/bench/$1.json"
  ;;
table32k)
  python3 benchmarks/decode_throughput.py --table-from /root/bench/vanilla32k.json \
      $(ls /root/bench/{quest32k,omnikv32k,retroinfer32k}.json 2>/dev/null) | tee /root/bench/table32k.txt
  ;;
fp8kv130k|fp8kv130k6|kivi130k|kivi130k6|turboquant130k|turboquant130k6)  # a quantized pool at 130K: at its
  install  # largest batch and at 6 (ours only). Largest: QUANT_BATCH, default 11 for fp8_kv (1.94x vanilla's pool),
           # 19 for kivi 4-bit (3.2x), 22 for turboquant 4-bit (3.76x: 1,088 bytes a token and layer, no residual)
  case "$1" in
  fp8kv130k) m=fp8_kv b="${QUANT_BATCH:-$(scaled 11)}" ;;
  kivi130k) m=kivi b="${QUANT_BATCH:-$(scaled 19)}" ;;
  turboquant130k) m=turboquant b="${QUANT_BATCH:-$(scaled 22)}" ;;
  fp8kv130k6) m=fp8_kv b="$VB" ;;
  kivi130k6) m=kivi b="$VB" ;;
  turboquant130k6) m=turboquant b="$VB" ;;
  esac
  name="$1${QUANT_TAG:+-$QUANT_TAG}"  # QUANT_CONFIG: the method's --sparse-config (QUANT_TAG names its files)
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$name.txt" python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$b" --output-len 256 --only sgl_sparse \
      --sparse-method "$m" --sparse-config "${QUANT_CONFIG:-{\}}" --log-dir "/root/bench/$name" --json "/root/bench/$name.json"
  ;;
palu130k|palu130k6)  # Palu at rank ratio PALU_RATIO (default 0.5) at 130K: at its largest batch PALU_BATCH (default 12:
  install          # 2,052 bytes a token and layer against bf16's 4,096, 1.996x vanilla's pool) and at 6, ours only.
  b=$([ "$1" = palu130k ] && echo "${PALU_BATCH:-$(scaled 12)}" || echo "$VB")
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/$1.txt" python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$b" --output-len 256 --only sgl_sparse \
      --sparse-method palu --sparse-config "$(palu_config)" \
      --sparse-server-args "${PALU_SERVER_ARGS:---mem-fraction-static 0.81}" \
      --log-dir "/root/bench/$1" --json "/root/bench/$1.json"
  ;;
paludiag)  # profiled decode steps of palu130k's server at PALU_BATCH (default 12; 5 on an H100), ~4 min: where a step's
  install  # time goes beside the decode kernel (profile_summary.py's kernels by total time); throughput not for tables
  export CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}"
  rm -rf /root/bench/paludiag
  python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 130000 --batch "$VB" \
      --sparse-batch "${PALU_BATCH:-$(scaled 12)}" --output-len 128 --only sgl_sparse --sparse-method palu \
      --sparse-config "$(palu_config)" --sparse-server-args "${PALU_SERVER_ARGS:---mem-fraction-static 0.81}" --profile-dir /root/bench/paludiag/prof \
      --log-dir /root/bench/paludiag --json /root/bench/paludiag/ours.json > /root/bench/paludiag.txt 2>&1 || true
  python3 benchmarks/profile_summary.py $(find /root/bench/paludiag/prof -name '*.trace.json.gz' | sort) \
      > /root/bench/paludiag-profile.txt 2>&1 || true
  ;;
snapkvfp8130k)  # SnapKV 8192 over the FP8 pool (snapkv+fp8_kv) at 130K x COMPOSE_BATCH (default 24; SnapKV alone:
  install        # snapkv130k at SPARSE_BATCH=24 beside it), ours only
  b="${COMPOSE_BATCH:-$(scaled 24)}"
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/snapkvfp8130k.txt" python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "$b" --output-len 256 --only sgl_sparse \
      --sparse-method snapkv+fp8_kv --sparse-config '{"snapkv": {"budget": 8192}}' --log-dir /root/bench/snapkvfp8130k \
      --json /root/bench/snapkvfp8130k.json
  ;;
quantdecode)  # decode attention over the quantized pools, one layer in a CUDA graph (benchmarks/quant_decode.py), no server
  install
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/quantdecode.txt python3 benchmarks/quant_decode.py \
      --warps ${QUANT_WARPS:-2 4 8} ${QUANT_ARGS:-}  # QUANT_ARGS: e.g. --shapes 6x130000 --kivi-pages 2 4
  ;;
ncudecode)  # ncu of one decode kernel launch (the first matching NCU_KERNEL, default _decode_kernel) under
  install    # quant_decode.py's QUANT_ARGS (e.g. --shapes 6x130000 --methods palu --palu-tiles T --palu-tiles-only):
             # stall reasons, scheduler, memory and occupancy sections; ~2 min
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/ncudecode.txt ncu --clock-control none -c 1 \
      -k "regex:${NCU_KERNEL:-_decode_kernel}" --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      python3 benchmarks/quant_decode.py ${QUANT_ARGS:---shapes 6x130000 --methods palu}
  ;;
quantprefill)  # extend attention over a quantized prefix (benchmarks/quant_prefill.py) beside FlashInfer bf16, no server
  install
  # shellcheck disable=SC2086  # QUANT_PREFILL_ARGS is a list of flags
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/quantprefill.txt python3 benchmarks/quant_prefill.py \
      ${QUANT_PREFILL_ARGS:-}  # e.g. --shapes 16384x114000 --fp8-tiles 32x128x8x3
  ;;
selection)  # Quest's per-layer selection stages (benchmarks/selection_overhead.py), no server
  install
  # shellcheck disable=SC2086  # SELECTION_ARGS is a list of flags
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/selection.txt python3 benchmarks/selection_overhead.py \
      ${SELECTION_ARGS:-}
  ;;
evict130k)  # EVICT_METHODS (default: h2o rkv skipkv kvzip pyramidkv) at 130K x EVICT_BATCH (default 6, vanilla's), default
  install    # configs and SGLang's defaults (decode CUDA graphs on), ours only, one server each (~3 min each);
  # EVICT_SERVER_ARGS: more flags for ours (e.g. --max-running-requests 96 for a batch past the default 64).
  for m in ${EVICT_METHODS:-h2o rkv skipkv kvzip pyramidkv}; do
    extra="${EVICT_SERVER_ARGS:-}"
    CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/${m}130k.txt" python3 \
        benchmarks/decode_throughput.py --model-path $MODEL --input-len 130000 --batch "$VB" \
        --sparse-batch "${EVICT_BATCH:-6}" --output-len 256 --only sgl_sparse --sparse-method "$m" --sparse-config '{}' \
        "--sparse-server-args=$extra" --log-dir "/root/bench/${m}130k" --json "/root/bench/${m}130k.json" || true
  done
  ;;
table130k)
  python3 benchmarks/decode_throughput.py --table-from /root/bench/vanilla130k.json \
      $(ls /root/bench/{dense130k,snapkv130k6,snapkv130k,snapkvfp8130k,streamingllm,quest130k,quest130k6,omnikv130k,retroinfer130k,retroinfer130k6,h2o130k,rkv130k,skipkv130k,kvzip130k,pyramidkv130k,fp8kv130k6,fp8kv130k,kivi130k6,kivi130k,turboquant130k6,turboquant130k,palu130k6,palu130k}.json /root/bench/*130k*-*.json 2>/dev/null) | tee /root/bench/table130k.txt
  ;;
streamingllm)  # StreamingLLM (default config) at 130K, STREAM_BATCH requests (default 24: ~6 min of prefill); ours only
  install
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/streamingllm.txt python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 130000 --batch "$VB" --sparse-batch "${STREAM_BATCH:-$(scaled 24)}" --output-len 256 \
      --only sgl_sparse --sparse-method streamingllm --sparse-config '{}' \
      --log-dir /root/bench/streamingllm --json /root/bench/streamingllm.json
  ;;
floorref)  # vanilla at SnapKV 8,192's per-request KV (8,448 in, 256 out) x FLOOR_BATCH (default 60)
  install
  b="${FLOOR_BATCH:-60}"
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch "/root/bench/floorref-$b.txt" python3 benchmarks/decode_throughput.py \
      --model-path $MODEL --input-len 8448 --batch "$b" --output-len 256 --only vanilla \
      --log-dir "/root/bench/floorref-$b" --json "/root/bench/floorref-$b.json"
  ;;
layout)  # FlashInfer decode on contiguous vs SnapKV-like vs random slot layouts, LAYOUT_BATCH (default 60) x 8,448
  install
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/layout.txt python3 benchmarks/attention_layout.py \
      --batch "${LAYOUT_BATCH:-60}" --kept 8448 --region 130000
  ;;
questdiag)  # decode-step profile of Quest (default config) at 32,768 in x QDIAG_BATCH (default 5), ~3 min: where
  install     # a step's time goes beyond the weights and the selected reads (kernels per layer, their count)
  export CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}"
  rm -rf /root/bench/questdiag
  SGLSPARSE_SYNC_DEBUG=warn PYTHONWARNINGS=always::UserWarning python3 benchmarks/decode_throughput.py --model-path $MODEL \
      --input-len 32768 --batch "${QDIAG_BATCH:-5}" --output-len 128 --only sgl_sparse --sparse-method quest --sparse-config '{}' \
      --profile-dir /root/bench/questdiag/prof --log-dir /root/bench/questdiag --json /root/bench/questdiag/ours.json \
      > /root/bench/questdiag.txt 2>&1 || true
  python3 benchmarks/profile_summary.py $(find /root/bench/questdiag/prof -name '*.trace.json.gz' | sort) \
      > /root/bench/questdiag-profile.txt 2>&1 || true
  { echo "synchronizing-op warnings (every occurrence): $(grep -c 'synchronizing' /root/bench/questdiag/*quest*.log)";
    grep -m1 -B2 -A12 'synchronizing' /root/bench/questdiag/*quest*.log; } >> /root/bench/questdiag-profile.txt 2>&1 || true
  ;;
diag)  # decode-step profile at SnapKV 8,192's per-request KV, cheap to prefill: ours SnapKV 8192 on 16,384-token
  install  # prompts and vanilla on 8,448 (both 8,448 live tokens a request) x DIAG_BATCH (default 52), ~6 min;
           # our list build scans 16K-position rows here, not 130K (the layout step times the 130K build)
  b="${DIAG_BATCH:-52}"
  export CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}"
  rm -rf /root/bench/diag
  nvidia-smi --query-gpu=$GPU_QUERY --format=csv -l 10 > /root/bench/diag-gpu.csv 2>&1 & smi=$!
  SGLSPARSE_SYNC_DEBUG=warn PYTHONWARNINGS=always::UserWarning python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 16384 \
      --batch "$b" --output-len 256 --only sgl_sparse --sparse-method snapkv --sparse-config '{"budget": 8192}' --profile-dir /root/bench/diag/prof \
      --log-dir /root/bench/diag --json /root/bench/diag/ours.json > /root/bench/diag-ours.txt 2>&1 || true
  python3 benchmarks/decode_throughput.py --model-path $MODEL --input-len 8448 --batch "$b" --output-len 256 \
      --only vanilla --profile-dir /root/bench/diag/prof \
      --log-dir /root/bench/diag --json /root/bench/diag/vanilla.json > /root/bench/diag-vanilla.txt 2>&1 || true
  python3 benchmarks/profile_summary.py $(find /root/bench/diag/prof -name '*.trace.json.gz' | sort) \
      > /root/bench/diag-profile.txt 2>&1 || true
  # Host syncs inside our decode-step code (SGLSPARSE_SYNC_DEBUG=warn): count and first stack.
  { echo "synchronizing-op warnings in ours (every occurrence): $(grep -c 'synchronizing' /root/bench/diag/*snapkv*.log)";
    grep -m1 -B2 -A12 'synchronizing' /root/bench/diag/*snapkv*.log; } >> /root/bench/diag-profile.txt 2>&1 || true
  python3 benchmarks/decode_throughput.py --table-from /root/bench/diag/vanilla.json /root/bench/diag/ours.json \
      > /root/bench/diag-table.txt 2>&1 || true
  kill $smi 2>/dev/null || true
  ;;
agent)  # bench_agent compare on the pool-overflowing trace: vanilla FlashInfer, then AGENT_METHODS
  install  # (default: snapkv 8192, dense; AGENT_DENSE=0 drops dense), each METHOD or METHOD:CONFIG_JSON
  methods=()
  default_methods='snapkv:{"budget":8192}'; [ "${AGENT_DENSE:-1}" = 1 ] && default_methods="$default_methods dense"
  for spec in ${AGENT_METHODS:-$default_methods}; do
    name=${spec%%:*}; cfg='{}'; [ "$spec" != "$name" ] && cfg=${spec#*:}
    methods+=(--sparse-method "$name" --sparse-config "$cfg")
  done
  python3 -m bench_agent generate --config bench_agent/configs/agent_overflow_h200.toml --out /root/bench/agent.jsonl
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/agent.txt python3 -m bench_agent compare \
      --model-path $MODEL --trace /root/bench/agent.jsonl --time-scale 0.5 --out /root/bench/agent \
      "${methods[@]}" ${AGENT_PRUNE_LAG:+--prune-lag "$AGENT_PRUNE_LAG"} \
      $([ "${AGENT_PRUNE_ONLY:-0}" = 1 ] && echo --prune-only) \
      --server-args='--load-format dummy --mem-fraction-static 0.80 --context-length 131072 --sampling-backend pytorch --disable-piecewise-cuda-graph --chunked-prefill-size 16384 --cuda-graph-max-bs 32'
  ;;
gputests)  # the GPU test suite (GPU_TESTS: files or node ids, default all of tests/gpu); logs in /root/bench/gpu-logs
  install
  # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
  SGL_SPARSE_GPU_LOG_DIR=/root/bench/gpu-logs CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" \
      launch /root/bench/gpu-tests.txt python3 -m pytest ${GPU_TESTS:-tests/gpu} -v
  ;;
gpukernels)  # the kernel-level GPU tests only (no servers, ~2 min): new Triton kernels compile and match torch
  install      # on the GPU before servers are spent on them; GPU_TESTS as for gputests
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES="${HEADLINE_GPU:-$DEFAULT_GPU}" launch /root/bench/gpu-kernels.txt \
      python3 -m pytest ${GPU_TESTS:-tests/gpu} -v -k "kernel or select_and"
  ;;
quality16k)  # quality-large at 16K under QUALITY_METHODS (default: dense, snapkv 2048 and 4096, streamingllm)
  eviction='dense snapkv:{"budget":2048} snapkv:{"budget":4096} streamingllm'
  QUALITY_METHODS="${QUALITY_METHODS:-$eviction}" QUALITY_TAG="${QUALITY_TAG:-eviction}" \
      QUALITY_GPU="${HEADLINE_GPU:-$DEFAULT_GPU}" bash "$0" quality sgl_sparse/assets/quality-large 16384
  ;;
quality16ksel)  # quality-large at 16K: quest, omnikv, retroinfer at their default configs (~1 min a method)
  QUALITY_METHODS="${QUALITY_METHODS:-quest omnikv retroinfer}" QUALITY_TAG="${QUALITY_TAG:-selection}" \
      QUALITY_GPU="${HEADLINE_GPU:-$DEFAULT_GPU}" bash "$0" quality sgl_sparse/assets/quality-large 16384
  ;;
quality16kevict)  # quality-large at 16K: h2o, rkv, skipkv at their defaults. Not kvzip: a 16K prompt fills the
  # model's 16,384-token context and leaves no room for its replay, so it would be served uncompressed (QUALITY.md);
  # `quality sgl_sparse/assets/quality-large 14300` with QUALITY_METHODS=kvzip leaves a 2,048-token chunk room.
  QUALITY_METHODS="${QUALITY_METHODS:-h2o rkv skipkv}" QUALITY_TAG="${QUALITY_TAG:-evict}" \
      QUALITY_GPU="${HEADLINE_GPU:-$DEFAULT_GPU}" bash "$0" quality sgl_sparse/assets/quality-large 16384
  ;;
quality16kquant)  # quality-large at 16K: fp8_kv, kivi 4 and 2 bits, turboquant 4 bits (~1 min a method)
  quant='fp8_kv kivi kivi:{"bits":2} turboquant'
  QUALITY_METHODS="${QUALITY_METHODS:-$quant}" QUALITY_TAG="${QUALITY_TAG:-quant}" \
      QUALITY_GPU="${HEADLINE_GPU:-$DEFAULT_GPU}" bash "$0" quality sgl_sparse/assets/quality-large 16384
  ;;
plan1|plan2|plan3|plan4|plan5)  # the benchmark plan, one GPU session each (~25 min of GPU time at most), most
  # important first; vanilla once per machine (a later plan on the same warm machine reuses its JSON). The rows
  # each step prints go into BENCHMARKS.md through `rows`.
  case "$1" in
  plan1) steps="evict130k" ;;  # h2o, rkv, skipkv, kvzip, pyramidkv at 130K x 6, decode graphs on (~5 x 3 min)
  plan2) steps="palu130k palu130k6 quantdecode" ;;  # Palu at its largest batch and at 6; every decode kernel
  plan3) steps="fp8kv130k kivi130k turboquant130k" ;;  # the quantized pools at their largest batches
  plan4) steps="quest130k6 omnikv130k retroinfer130k" ;;  # selection at 130K
  plan5) steps="vanilla32k quest32k omnikv32k retroinfer32k" ;;  # selection at 32K x 16 (its own vanilla)
  esac
  [ -e /root/bench/vanilla130k.json ] || [ "$1" = plan5 ] || steps="vanilla130k $steps"
  # shellcheck disable=SC2086  # the steps are words
  bash "$0" queue $steps
  ;;
rows)  # BENCHMARKS.md rows from this machine's result JSONs (each against this machine's vanilla):
  # ROWS_DATE, ROWS_GPU (default: from nvidia-smi), ROWS_RUN (the results folder it will be committed as)
  gpu="${ROWS_GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]*')}"
  for base in vanilla130k vanilla32k; do
    [ -e "/root/bench/$base.json" ] || continue
    size=${base#vanilla}
    # shellcheck disable=SC2046  # file names
    python3 benchmarks/bench_rows.py --date "${ROWS_DATE:-$(date +%F)}" --gpu "$gpu" --run "${ROWS_RUN:-}" \
        --notes "${ROWS_DATE:-$(date +%F)}/NOTES.md" "/root/bench/$base.json" \
        $(ls /root/bench/*"$size"*.json 2>/dev/null | grep -v "/$base.json") | tee "/root/bench/rows$size.md"
  done
  ;;
queue)  # queue STEP...: run the steps one after another, detached; progress in /root/bench/queue.txt
  shift
  install
  echo "$(date +%T) queue $*" >> /root/bench/queue.txt
  FOREGROUND=1 setsid nohup bash -c 'for s in "$@"; do echo "$(date +%T) begin $s" >> /root/bench/queue.txt
      bash tools/device/device_session.sh "$s"; echo "$(date +%T) end $s" >> /root/bench/queue.txt; done' \
      _ "$@" > /root/bench/queue.log 2>&1 < /dev/null &
  ;;
train)
  install
  for m in ${TRAIN_MODELS:-large small}; do
    if [ "$m" = large ]; then
      from="${LARGE_FROM:-}" gpu="${LARGE_GPU:-0}" ctx="${LARGE_CONTEXT:-2048}"
      batch=$((32 * 2048 / ctx > 4 ? 32 * 2048 / ctx : 4)) lr=${LARGE_LR:-6e-4}
      weights="${LARGE_TASK_WEIGHTS:-vartrack=2,niah_multikey=2,agent_recall=2}"
      # Past 2K, keep prompts from 1K up in the mix, so the model stays right at short contexts too.
      minctx=${LARGE_MIN_CONTEXT:-$((ctx > 2048 ? 1024 : 0))}
    else
      from="${SMALL_FROM:-sgl_sparse/assets/quality-small}" gpu="${SMALL_GPU:-0}" ctx=2048 batch=32 lr=5e-4 minctx=0
      weights="vartrack=3"
    fi
    init=(--size "$m")
    if [ -n "$from" ]; then
      rm -rf "/root/train/$m-init" && cp -r "$from" "/root/train/$m-init"  # a carried path may not outlive the command
      init=(--init-from "/root/train/$m-init")  # a fresh optimizer on trained weights
    fi
    CUDA_VISIBLE_DEVICES="$gpu" setsid nohup python3 training/train.py "${init[@]}" --out "/root/train/$m" \
        --context "$ctx" --batch "$batch" --steps 100000 --lr "$lr" --workers 7 --eval-every 250 \
        --task-weights "$weights" --confusable 0.5 --time-limit-s "${TRAIN_S:-1150}" \
        --task-eval-every "${TASK_EVAL_EVERY:-2000}" ${STOP_AT:+--stop-at "$STOP_AT"} \
        $([ "$minctx" -gt 0 ] && echo --min-context "$minctx") \
        > "/root/train/$m.txt" 2>&1 < /dev/null &
  done
  ;;
quality)
  install
  dir="${2:?quality DIR TOKENS...}"; shift 2
  name=$(basename "$dir")${QUALITY_TAG:+-$QUALITY_TAG}
  # QUALITY_METHODS: e.g. 'dense snapkv:{"budget":2048} snapkv:{"budget":4096} streamingllm' (default dense)
  read -r -a methods <<< "${QUALITY_METHODS:-dense}"
  CUDA_VISIBLE_DEVICES="${QUALITY_GPU:-0}" python3 benchmarks/quality_suite.py --device cuda --model-dir "$dir" \
      --tokens "${@:-2048}" --n "${QUALITY_N:-50}" --parallel 32 --methods "${methods[@]}" \
      --json "/root/bench/quality-$name.json" --log-dir /root/bench "--server-args=${QUALITY_SERVER_ARGS:-}" \
      2>&1 | tee "/root/bench/quality-$name.txt" | tail -n 15
  ;;
status)
  for name in decode_throughput.py "train.py.*--out /root/train/large" "train.py.*--out /root/train/small" \
      quality_suite.py "bench_agent compare" "pytest tests/gpu" attention_layout.py selection_overhead.py quant_decode.py quant_prefill.py; do
    echo "$name: $(pgrep -f "^python3 .*$name" >/dev/null && echo running || echo stopped)"
  done
  [ -e /root/bench/queue.txt ] && tail -n 4 /root/bench/queue.txt
  for f in /root/bench/{headline,vanilla130k,dense130k,snapkv130k,snapkv130k6,quest130k,omnikv130k,retroinfer130k,questdiag,fp8kv130k,fp8kv130k6,kivi130k,kivi130k6,turboquant130k,turboquant130k6,streamingllm,floorref-*}/*.log; do
    [ -e "$f" ] && echo "$f: $(grep -E 'Prefill batch|Decode batch' "$f" | tail -n 1 | cut -c1-160)"
  done
  (tail -n 2 /root/bench/*.txt /root/train/*.txt 2>/dev/null || true) | cut -c1-300  # some may not exist yet
  for f in /root/train/*.txt; do  # the latest held-out exact match per task
    [ -e "$f" ] && echo "$f: $(grep held_out_em "$f" | tail -n 1 | cut -c1-300)"
  done
  # Every poll brings the logs back, so a machine lost later still leaves the last poll's results.
  if [ -n "${OUT:-}" ]; then pack_logs 2>/dev/null || true; fi
  ;;
wait)
  [[ "${2:-560}" =~ ^[0-9]+$ ]] || { echo "wait S: S is whole seconds, not '$2'" >&2; exit 2; }
  deadline=$((SECONDS + ${2:-560}))
  training() { pgrep -f "^python3 .*train.py" >/dev/null; }
  while training && [ $SECONDS -lt $deadline ]; do sleep 5; done
  if training; then exec bash "$0" status; else exec bash "$0" collect; fi
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
  echo "usage: $0 headline|vanilla130k|dense130k|snapkv130k|snapkv130k6|quest130k|quest130k6|retroinfer130k6|omnikv130k|fp8kv130k|fp8kv130k6|kivi130k|kivi130k6|turboquant130k|turboquant130k6|snapkvfp8130k|palu130k|palu130k6|paludiag|quantdecode|ncudecode|plan1|plan2|plan3|plan4|plan5|rows|selection|questdiag|quality16ksel|quality16kquant|table130k|streamingllm|floorref|layout|diag|agent|gputests|gpukernels|quality16k|queue STEP...|train|quality DIR TOKENS...|status|wait [S]|collect" >&2
  exit 2 ;;
esac
