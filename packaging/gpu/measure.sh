#!/usr/bin/env bash
# GPU measurements for docs/benchmarks.md ("GPU nodes"), on the lent GPU machine with the kit
# of ../shared/gpu copied to .gpukit (see its README). Parts, each under 10 minutes, run
# back to back on one warm machine (part 1 builds llama.cpp with CUDA and writes the models
# into /tmp/gpumodels; part 2 reuses both):
#
#   . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 1 "$OUT"
#   . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 2 "$OUT"
#
# Every step has its own time limit and appends to $OUT/part<N>.log; a failed step is
# reported and the next one runs. MEASURE_DRY=1 runs the same steps on CPU with tiny sizes
# (a check of the script itself, not a measurement).
set -u
PART=${1:?part 1-38}
OUT=${2:?output folder}
M=${MEASURE_MODELS:-/tmp/gpumodels}
HOME_DIR=${MEASURE_HOME:-/tmp/gpuhome}
LOG="$OUT/part$PART.log"
mkdir -p "$M" "$HOME_DIR" "$OUT"
export MESHNODE_HOME="$HOME_DIR" MESHNODE_KEYRING=file PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mn() { "$PY" -m meshnode "$@"; }
KIT=$(cd "$(dirname "$0")/../.." && pwd)/.gpukit
DRY=${MEASURE_DRY:-0}

step() {   # step SECONDS TITLE CMD...: run with a limit, log output and wall time
  local limit=$1 title=$2; shift 2
  echo "=== $title" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $title: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  return $rc
}

schedule() {   # schedule MODEL LABEL [ENV=V ...] -- [certify flags]: one batch-schedule check
  local model=$1 label=$2; shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  step 100 "schedule $label" env "${envs[@]}" "$PY" -m meshnode models certify "$model" --schedule \
    --gpu-layers all "$@"
}

if [ "$PART" = 1 ]; then
  step 30 "devices" "$PY" - <<'PY'
from meshnode.engine.offload import gpu_devices, backend_summary
print(gpu_devices()); print(backend_summary())
from meshnode.mesh.local_caps import local_capabilities
print(local_capabilities())
PY
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >>"$LOG" 2>&1
  if [ "$DRY" = 1 ]; then
    step 120 "write 1b (dry: tiny)" "$PY" "$KIT/mkmodels.py" tiny "$M/l1b.gguf"
    step 120 "write 8b (dry: tiny)" "$PY" "$KIT/mkmodels.py" tiny "$M/l8b.gguf"
  else
    step 200 "write 8b Q4_0" "$PY" "$KIT/mkmodels.py" 8b "$M/l8b.gguf" Q4_0
    step 120 "write 1b f16" "$PY" "$KIT/mkmodels.py" 1b "$M/l1b.gguf"
  fi
  # one-row steps against windows on the GPU: llama.cpp's defaults, then the candidates
  # that are settable at run time (the MMQ/cuBLAS choice is a build option of ggml-cuda)
  schedule "$M/l1b.gguf" "l1b default" -- --json
  schedule "$M/l1b.gguf" "l1b flash-attn off" -- --flash-attn off --json
  schedule "$M/l1b.gguf" "l1b no CUDA graphs, flash-attn off" GGML_CUDA_DISABLE_GRAPHS=1 -- --flash-attn off --json
fi

if [ "$PART" = 2 ]; then
  TOK=64; ROUNDS=3
  [ "$DRY" = 1 ] && { TOK=8; ROUNDS=1; }
  step 60 "certify 1b split 4,8 on the GPU" "$PY" -m meshnode models certify "$M/l1b.gguf" --splits 4,8 \
    --gpu-layers all --json
  step 90 "bench engine 8b, all layers on the GPU, 2 stages" "$PY" -m meshnode bench engine "$M/l8b.gguf" --splits 16 \
    --gpu-layers all --tokens $TOK --reps 3
  step 200 "bench serve 8b: 1 vs 2 stages on one GPU" "$PY" -m meshnode bench serve --model "$M/l8b.gguf" --stages 1,2 \
    --concurrency 1 --tokens $TOK --rounds $ROUNDS --gpu-layers all --threads 4 --json
  step 150 "bench spec 1b on the GPU" "$PY" -m meshnode bench spec --model "$M/l1b.gguf" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --threads 4 --delay-ms 0 --json
fi
if [ "$PART" = 3 ]; then   # the GPU defaults (one-row steps padded to 2 rows, flash attention off)
  [ -f "$M/l8b.gguf" ] || step 200 "write 8b Q4_0" "$PY" "$KIT/mkmodels.py" 8b "$M/l8b.gguf" Q4_0
  [ -f "$M/l1b.gguf" ] || step 120 "write 1b f16" "$PY" "$KIT/mkmodels.py" 1b "$M/l1b.gguf"
  schedule "$M/l8b.gguf" "l8b GPU defaults, windows 2-4" -- --windows 2,3,4 --json
  schedule "$M/l8b.gguf" "l8b GPU defaults, windows 2-32" -- --json
  schedule "$M/l1b.gguf" "l1b GPU defaults, windows 2-16" -- --windows 2,4,8,16 --json
  step 80 "bench spec 1b on the GPU, windows <= 4 rows" "$PY" -m meshnode bench spec --model "$M/l1b.gguf" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --threads 4 --delay-ms 0 --draft-max 3 --json
  step 110 "bench spec 8b on the GPU, windows <= 4 rows" "$PY" -m meshnode bench spec --model "$M/l8b.gguf" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --threads 4 --delay-ms 0 --draft-max 3 --json
  step 120 "bench serve 8b with the GPU defaults" "$PY" -m meshnode bench serve --model "$M/l8b.gguf" --stages 1,2 \
    --concurrency 1 --tokens 64 --rounds 3 --gpu-layers all --threads 4 --json
fi
# Parts 4-6: the split's speed and speculation with the GPU defaults (a stage wholly on the
# GPU computes on one CPU thread, inline on the event loop; windows capped at 4 rows by the
# coordinator). One GPU: part 4 (builds, writes l8b), then part 5 on the same warm machine,
# with SmolLM2's GGUF carried in two halves (.gpukit/smol/part1 in the first call, part2 in
# the second: the GGUF of the model wheel cut at 40,000,000 bytes). Two GPUs: part 6 (carrying
# part1), then part 5 on the same warm machine; part 7 compares inline steps with the compute
# thread. The kit's folder is not carried again after the first call: later calls put
# /tmp/site on PYTHONPATH and set LD_PRELOAD as device-setup.sh does. As run (2x H200):
#   carry [.gpukit, .gpuwt/gpu2]:  . .gpukit/device-setup.sh && cd .gpuwt/gpu2 &&
#     ln -sfn ../../.gpukit .gpukit && export PYTHONPATH=$PWD:$PYTHONPATH && bash packaging/gpu/measure.sh 6 "$OUT"
#   carry [.gpuwt/gpu2, .gpuwt/smol]:  export LD_PRELOAD=<system libstdc++.so.6>; cd .gpuwt/gpu2 &&
#     export PYTHONPATH=$PWD:/tmp/site && cp ../smol/part2 /tmp/smol/ &&
#     CUDA_VISIBLE_DEVICES=0 bash packaging/gpu/measure.sh 5 "$OUT"
# (.gpuwt/gpu2: a copy of this checkout's meshnode, packaging, assets and pyproject.toml, for
# a device call that sends another checkout.)
SMOLDIR=${MEASURE_SMOL:-/tmp/smol}
SMOL=$SMOLDIR/SmolLM2-135M-Instruct.Q4_1.gguf
serve_l8b() {   # serve_l8b TITLE [bench serve flags]: 1 vs 2 stages, l8b, every layer on the GPU
  local title=$1; shift
  step 240 "$title" "$PY" -m meshnode bench serve --model "$M/l8b.gguf" --stages 1,2 --concurrency 1 \
    --tokens ${TOK:-64} --rounds ${ROUNDS:-3} --gpu-layers all --json "$@"
}
write_l8b() {
  if [ "$DRY" = 1 ]; then
    [ -f "$M/l8b.gguf" ] || step 120 "write 8b (dry: tiny)" "$PY" "$KIT/mkmodels.py" tiny "$M/l8b.gguf"
  else
    [ -f "$M/l8b.gguf" ] || step 200 "write 8b Q4_0" "$PY" "$KIT/mkmodels.py" 8b "$M/l8b.gguf" Q4_0
  fi
}
[ "$DRY" = 1 ] && { TOK=8; ROUNDS=1; }
if [ "$PART" = 4 ]; then
  mkdir -p "$SMOLDIR" && cp "$KIT"/smol/part1 "$SMOLDIR"/ 2>/dev/null
  write_l8b
  serve_l8b "bench serve 8b, one GPU, --threads 1 (steps inline)" --threads 1
  nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
fi
if [ "$PART" = 5 ]; then
  mkdir -p "$SMOLDIR" && cp "$KIT"/smol/part2 "$SMOLDIR"/ 2>/dev/null
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  # n-gram speculation with the GPU defaults and no window flag: the coordinator caps the
  # windows (a CUDA stage); the text must equal plain decoding's
  step 200 "bench spec SmolLM2 on the GPU, 2 stages" "$PY" -m meshnode bench spec --model "$SMOL" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --delay-ms 0 --json
  step 150 "bench serve SmolLM2, one GPU (one node's plain decoding)" "$PY" -m meshnode bench serve \
    --model "$SMOL" --stages 1,2 --concurrency 1 --tokens ${TOK:-64} --rounds ${ROUNDS:-3} --gpu-layers all --json
fi
if [ "$PART" = 6 ]; then   # two GPUs of one host: one node process per GPU against one node on one
  mkdir -p "$SMOLDIR" && cp "$KIT"/smol/part1 "$SMOLDIR"/ 2>/dev/null   # for part 5 after it
  write_l8b
  serve_l8b "bench serve 8b, one node process per GPU (--cuda-devices 0,1)" --cuda-devices 0,1
  serve_l8b "bench serve 8b, both stages on GPU 0 (--cuda-devices 0)" --cuda-devices 0
  nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
fi
if [ "$PART" = 7 ]; then   # inline steps or the compute thread: --threads 4 against 1, one GPU
  write_l8b
  serve_l8b "bench serve 8b, one GPU, --threads 4 (steps on the compute thread)" --cuda-devices 0 --threads 4
  serve_l8b "bench serve 8b, one GPU, --threads 1 (steps inline)" --cuda-devices 0 --threads 1
fi
# Parts 8-10: where a second llama.cpp call's time goes, and GPU steps padded to more rows
# (MESHNODE_GPU_PAD_ROWS; windows up to 8 rows exact at 8). One GPU. The device call sends
# the session's main checkout, so this checkout goes as an ignored copy (.gpuwt/gpu3:
# meshnode, packaging, assets, pyproject.toml) with the kit beside it (.gpuwt/kit, holding
# smol/part1) and the second half of SmolLM2's GGUF (.gpuwt/p2/part2):
#   carry [.gpuwt/kit, .gpuwt/gpu3]:  . .gpuwt/kit/device-setup.sh && cd .gpuwt/gpu3 &&
#     ln -sfn ../kit .gpukit && export PYTHONPATH=$PWD:/tmp/site && bash packaging/gpu/measure.sh 8 "$OUT"
#   carry [.gpuwt/kit, .gpuwt/gpu3, .gpuwt/p2]: the same with part 9 (a fresh machine), then
#   part 10 on the same warm machine (carry [.gpuwt/gpu3]).
if [ "$PART" = 8 ]; then
  write_l8b
  step 100 "pad widths on l8b: exactness of windows and ms per one-row step" \
    "$PY" "$(dirname "$0")/pad_probe.py" "$M/l8b.gguf" 1,2,4,8
  step 150 "split timing l8b, llama.cpp defaults" "$PY" "$(dirname "$0")/split_timing.py" "$M/l8b.gguf" default 1,2,8
fi
P2=${MEASURE_P2:-$KIT/../p2/part2}
smol() { mkdir -p "$SMOLDIR" && [ -f "$SMOL" ] || cat "$KIT"/smol/part1 "$P2" > "$SMOL"; }
if [ "$PART" = 9 ]; then   # n-gram speculation on a 2-stage GPU split against one node's plain decoding
  smol
  step 170 "bench spec SmolLM2 on the GPU, 2 stages, steps padded to 8 rows (windows <= 8)" \
    env MESHNODE_GPU_PAD_ROWS=8 "$PY" -m meshnode bench spec --model "$SMOL" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --delay-ms 0 --json
  step 100 "bench serve SmolLM2, one GPU (one node's plain decoding)" "$PY" -m meshnode bench serve \
    --model "$SMOL" --stages 1,2 --concurrency 1 --tokens ${TOK:-64} --rounds ${ROUNDS:-3} --gpu-layers all --json
  step 40 "pad widths on SmolLM2" "$PY" "$(dirname "$0")/pad_probe.py" "$SMOL" 1,2,8
  step 170 "bench spec SmolLM2 on the GPU, 2 stages, GPU defaults (windows <= 4)" \
    "$PY" -m meshnode bench spec --model "$SMOL" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --delay-ms 0 --json
fi
if [ "$PART" = 10 ]; then
  write_l8b
  step 60 "split timing l8b, CUDA graphs off" env GGML_CUDA_DISABLE_GRAPHS=1 \
    "$PY" "$(dirname "$0")/split_timing.py" "$M/l8b.gguf" no-cuda-graphs 1
  step 60 "split timing l8b, graph reuse off" env LLAMA_GRAPH_REUSE_DISABLE=1 \
    "$PY" "$(dirname "$0")/split_timing.py" "$M/l8b.gguf" no-graph-reuse 1
  schedule "$M/l8b.gguf" "l8b, steps padded to 8 rows, windows 2-8" MESHNODE_GPU_PAD_ROWS=8 -- --windows 2,3,4,5,6,7,8 --json
fi
# Part 11: where a decode token's time goes on the GPU, marked in the nodes (bench serve's
# token path), steps inline and on the compute thread. One GPU, a fresh machine:
#   carry [.gpukit]:  . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 11 "$OUT"
if [ "$PART" = 11 ]; then
  write_l8b
  serve_l8b "bench serve 8b, one GPU, --threads 1 (steps inline)" --threads 1
  serve_l8b "bench serve 8b, one GPU, --threads 4 (compute thread)" --threads 4
fi
# Part 12: the split's speed on one GPU and on two (one node process per GPU), with wide
# decode rows on the fast lane; steps inline (MEASURE_THREADS=4: on the compute thread).
# Two GPUs of one host, a fresh machine:
#   carry [.gpukit], kind nvidia-h100-x2:  . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 12 "$OUT"
if [ "$PART" = 12 ]; then
  write_l8b
  T=${MEASURE_THREADS:-1}
  serve_l8b "bench serve 8b, both stages on GPU 0 (--cuda-devices 0), --threads $T" --cuda-devices 0 --threads "$T"
  serve_l8b "bench serve 8b, one node process per GPU (--cuda-devices 0,1), --threads $T" --cuda-devices 0,1 --threads "$T"
  nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
fi
# Parts 13-15: busy polling (meshnode serve --busy-poll, net/busypoll.py) against sleeping
# waits, each in its own bench serve run with its own one-node baseline: part 13 on two
# GPUs (one node process per GPU), part 14 on one; part 15 runs n-gram speculation on a
# 2-stage split of SmolLM2 on one GPU (windows up to 8 rows, exact with steps padded to 8),
# its GGUF carried in two halves (.gpuwt/smol/part1 with part 13 or 14, part2 with part 15:
# .gpukit and part2 together exceed what a call carries). On a 2-GPU machine, fresh, then
# part 15 on the same warm machine (within 30 s, naming the same kind):
#   carry [.gpukit, .gpuwt/smol], kind nvidia-h100-x2:
#     . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 14 "$OUT"
#   carry [.gpuwt/smol] (part2 now), kind nvidia-h100-x2, with what device-setup.sh set by hand:
#     export PYTHONPATH=$PWD:/tmp/site MESHNODE_KEYRING=file LD_PRELOAD=<system libstdc++.so.6>
#     bash packaging/gpu/measure.sh 15 "$OUT"
if [ "$PART" = 13 ] || [ "$PART" = 14 ]; then
  mkdir -p "$SMOLDIR" && cp "$(dirname "$KIT")"/.gpuwt/smol/part1 "$SMOLDIR"/ 2>/dev/null
  write_l8b
  T=${MEASURE_THREADS:-1}
  if [ "$PART" = 13 ]; then DEV=0,1; WHERE="one node process per GPU"; else DEV=0; WHERE="both stages on GPU 0"; fi
  serve_l8b "bench serve 8b, $WHERE, sleeping waits" --cuda-devices $DEV --threads "$T"
  serve_l8b "bench serve 8b, $WHERE, --busy-poll" --cuda-devices $DEV --threads "$T" --busy-poll
  nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
fi
if [ "$PART" = 15 ]; then
  mkdir -p "$SMOLDIR" && cp "$(dirname "$KIT")"/.gpuwt/smol/part2 "$SMOLDIR"/ 2>/dev/null
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 200 "bench spec SmolLM2, 2 stages on GPU 0, steps padded to 8 rows (windows <= 8), --busy-poll" \
    env MESHNODE_GPU_PAD_ROWS=8 CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" --quick \
    --strategies baseline,ngram_auto --gpu-layers all --delay-ms 0 --busy-poll --json
  step 120 "bench serve SmolLM2, one GPU (one node's plain decoding), --busy-poll" env CUDA_VISIBLE_DEVICES=0 \
    "$PY" -m meshnode bench serve --model "$SMOL" --stages 1,2 --concurrency 1 --tokens 64 --rounds 2 \
    --gpu-layers all --busy-poll --json
fi
# Part 16: n-gram speculation on a GPU split, a change against an earlier tree (written
# to compare window controllers, spec/window.py and spec/cost_model.py):
# n-gram on a 2-stage SmolLM2 split on GPU 0, steps padded to 8 rows and to 2 (the
# default), each bench spec run against its own baseline; with MEASURE_OLD=DIR (a tree
# of an earlier commit, e.g. `git archive` unpacked there) the same runs with that tree
# first on PYTHONPATH, for a before/after in one call. Carried like part 15 (part1 of the
# GGUF in a first call that also runs device-setup.sh, part2 in this one):
#   carry [.gpukit, .gpuwt/smol/part1]:  . .gpukit/device-setup.sh &&
#     mkdir -p /tmp/smol && cp .gpuwt/smol/part1 /tmp/smol/
#   carry [.gpuwt/smol/part2, .gpuwt/old.tgz], at once (the machine waits 30 s):
#     export PYTHONPATH=$PWD:/tmp/site MESHNODE_KEYRING=file LD_PRELOAD=<system libstdc++.so.6>
#     mkdir -p /tmp/old && tar xzf .gpuwt/old.tgz -C /tmp/old && MEASURE_OLD=/tmp/old bash packaging/gpu/measure.sh 16 "$OUT"
if [ "$PART" = 16 ]; then
  mkdir -p "$SMOLDIR" && cp "$(dirname "$KIT")"/.gpuwt/smol/part2 "$SMOLDIR"/ 2>/dev/null
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  OLD=${MEASURE_OLD:-}
  for pad in 8 2; do
    spec_smol() {   # spec_smol LABEL [ENV=V ...]
      local label=$1; shift
      step 200 "bench spec SmolLM2, 2 stages on GPU 0, pad $pad, --busy-poll$label" \
        env "$@" MESHNODE_GPU_PAD_ROWS=$pad CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
        --quick --strategies baseline,ngram_auto --gpu-layers all --delay-ms 0 --busy-poll --json
    }
    [ -n "$OLD" ] && spec_smol " (earlier tree)" PYTHONPATH="$OLD:${PYTHONPATH:-}"
    spec_smol "" PYTHONPATH="${PYTHONPATH:-}"
  done
  step 120 "bench serve SmolLM2, one GPU (one node's plain decoding), --busy-poll" env CUDA_VISIBLE_DEVICES=0 \
    "$PY" -m meshnode bench serve --model "$SMOL" --stages 1,2 --concurrency 1 --tokens 64 --rounds 2 \
    --gpu-layers all --busy-poll --json
fi
# Part 17: the split's speed and token path, a change against an earlier tree (written
# for stage 0's step ordering and the stage host's inline lane steps): bench serve, 1 vs 2
# stages on GPU 0, --threads 1, for l8b and SmolLM2, the earlier tree (MEASURE_OLD=DIR, as
# in part 16) and this one alternated MEASURE_REPS times (2), each run with its own
# one-node baseline; MEASURE_WHICH="l8b smol" picks the models (a call has 10 minutes).
# Carried like part 16, the first call also writing l8b:
#   carry [.gpukit, .gpuwt/smol/part1]:  . .gpukit/device-setup.sh &&
#     mkdir -p /tmp/smol && cp .gpuwt/smol/part1 /tmp/smol/ && python3 .gpukit/mkmodels.py 8b /tmp/gpumodels/l8b.gguf Q4_0
#   carry [.gpuwt/smol/part2, .gpuwt/old.tgz], at once: (the exports of part 16)
#     mkdir -p /tmp/old && tar xzf .gpuwt/old.tgz -C /tmp/old && MEASURE_OLD=/tmp/old bash packaging/gpu/measure.sh 17 "$OUT"
if [ "$PART" = 17 ]; then
  mkdir -p "$SMOLDIR" && cp "$(dirname "$KIT")"/.gpuwt/smol/part2 "$SMOLDIR"/ 2>/dev/null
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  write_l8b
  OLD=${MEASURE_OLD:-}
  serve_pair() {   # serve_pair LABEL PYTHONPATH MODEL
    step 240 "bench serve $1, 1 vs 2 stages on GPU 0, --threads 1" env PYTHONPATH="$2" CUDA_VISIBLE_DEVICES=0 \
      "$PY" -m meshnode bench serve --model "$3" --stages 1,2 --concurrency 1 --tokens ${TOK:-64} \
      --rounds ${ROUNDS:-3} --gpu-layers all --threads 1 --json
  }
  for r in $(seq "${MEASURE_REPS:-2}"); do
    for which in ${MEASURE_WHICH:-l8b smol}; do
      if [ "$which" = l8b ]; then model=$M/l8b.gguf; else model=$SMOL; fi
      name=$(basename "$model" .gguf)
      [ -n "$OLD" ] && serve_pair "$name (earlier tree)" "$OLD:${PYTHONPATH:-}" "$model"
      serve_pair "$name" "${PYTHONPATH:-}" "$model"
    done
  done
fi
# Part 18: the current tree's split with busy polling, l8b, 1 vs 2 stages, --threads 1,
# each run with its own one-node baseline; MEASURE_RUNS picks the runs, in order, from
# gpu0-busy (both stages on GPU 0, --busy-poll), gpu0-sleep (the same, sleeping waits) and
# gpu01-busy (one node process per GPU, --busy-poll: the 2-GPU kind). The first call also
# writes l8b (~2 min after the kit's build), so give it one run:
#   carry [.gpukit], kind nvidia-h200-x2:  . .gpukit/device-setup.sh &&
#     MEASURE_RUNS=gpu0-busy bash packaging/gpu/measure.sh 18 "$OUT"
#   at once (the machine waits 30 s): export PYTHONPATH=$PWD:/tmp/site MESHNODE_KEYRING=file
#     LD_PRELOAD=<system libstdc++.so.6>; MEASURE_RUNS="gpu01-busy gpu0-sleep ..." bash packaging/gpu/measure.sh 18 "$OUT"
if [ "$PART" = 18 ]; then
  write_l8b
  for run in ${MEASURE_RUNS:-gpu0-busy gpu0-sleep gpu01-busy}; do
    case $run in
      gpu0-busy) serve_l8b "bench serve 8b, both stages on GPU 0, --threads 1, --busy-poll" --cuda-devices 0 --threads 1 --busy-poll ;;
      gpu0-sleep) serve_l8b "bench serve 8b, both stages on GPU 0, --threads 1, sleeping waits" --cuda-devices 0 --threads 1 ;;
      gpu01-busy) serve_l8b "bench serve 8b, one node process per GPU, --threads 1, --busy-poll" --cuda-devices 0,1 --threads 1 --busy-poll ;;
      *) echo "=== unknown run $run" | tee -a "$LOG" ;;
    esac
  done
fi
# Part 19: what a re-plan saves a stage that keeps its range: l8b whole and its two halves
# loaded wholly onto the GPU against taken back from the node's EngineShelf
# (load_timing.py; one call on a fresh machine: the kit's build, l8b, then the loads).
if [ "$PART" = 19 ]; then
  write_l8b
  step 400 "load timing l8b, every layer on the GPU" "$PY" "$(dirname "$0")/load_timing.py" "$M/l8b.gguf" all 3
fi
# Part 20: issue 23's measure where verify rows are nearly free: the held-out prompts
# (docs/benchmarks.md, "Measured by hand") through a 2-stage SmolLM2 split on GPU 0 with
# the default 5 ms each way of the relay, baseline against n-gram auto, wall clock and
# decode rate; steps padded to 2 rows (the default: windows up to 4 rows) and to 8.
# Two chained calls (the GGUF is carried in halves):
#   carry [.gpukit, .gpuwt/smol/part1]:  . .gpukit/device-setup.sh &&
#     mkdir -p /tmp/smol && cp .gpuwt/smol/part1 /tmp/smol/
#   carry [.gpuwt/smol/part2], at once:  export PYTHONPATH=$PWD:/tmp/site MESHNODE_KEYRING=file
#     LD_PRELOAD=<system libstdc++.so.6>; cp .gpuwt/smol/part2 /tmp/smol/ && bash packaging/gpu/measure.sh 20 "$OUT"
if [ "$PART" = 20 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 330 "bench spec SmolLM2 held-out, 2 stages on GPU 0, 5 ms each way, pad 2, --busy-poll" \
    env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" --set heldout --tokens 96 \
    --rounds 2 --strategies baseline,ngram_auto --gpu-layers all --busy-poll --json
  step 200 "bench spec SmolLM2 held-out (quick), 2 stages on GPU 0, 5 ms each way, pad 8, --busy-poll" \
    env MESHNODE_GPU_PAD_ROWS=8 CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
    --set heldout --quick --strategies baseline,ngram_auto --gpu-layers all --busy-poll --json
fi
# Part 21: the draft-model strategy against n-gram auto where verify rows are nearly free:
# the same held-out run as part 20 (pad 2) with the draft (the target requantized to
# Q4_0, on the GPU too), then the quick subset at pad 8 (windows up to 7 drafts).
# Carried and chained like part 20.
if [ "$PART" = 21 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 400 "bench spec SmolLM2 held-out, 2 stages on GPU 0, 5 ms each way, pad 2, draft model, --busy-poll" \
    env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" --set heldout --tokens 96 \
    --rounds ${MEASURE_ROUNDS:-2} --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json
  step 150 "bench spec SmolLM2 held-out (quick), 2 stages on GPU 0, 5 ms each way, pad 8, draft model, --busy-poll" \
    env MESHNODE_GPU_PAD_ROWS=8 CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
    --set heldout --quick --strategies baseline,draft --gpu-layers all --busy-poll --json
fi
# Part 22: the KV-bucket rule (limits.gpu_bucket_drafts, docs/engine.md "GPU") on a GPU:
# certify --schedule, whose windows a GPU engine cuts like a route does, at contexts whose
# one-row steps stay inside a 256-cell bucket (200, 600) and cross an edge (240, 480), on a
# tiny random model and on SmolLM2 when /tmp/smol holds it; every case should be exact.
# Without the rule (before it) context 480 differed in the row at position 511. One call
# on a fresh machine: carry [.gpukit]:  . .gpukit/device-setup.sh && bash packaging/gpu/measure.sh 22 "$OUT"
if [ "$PART" = 22 ]; then
  [ -f "$M/tiny.gguf" ] || step 60 "write tiny" "$PY" "$KIT/mkmodels.py" tiny "$M/tiny.gguf"
  step 120 "schedule tiny, contexts across KV buckets" "$PY" -m meshnode models certify "$M/tiny.gguf" --schedule \
    --gpu-layers all --contexts 200,240,480,600 --windows 2,3,4
  [ -f "$SMOL" ] && step 200 "schedule SmolLM2, contexts across KV buckets" "$PY" -m meshnode models certify "$SMOL" \
    --schedule --gpu-layers all --contexts 200,240,480,1000,1020 --windows 2,3,4
  step 120 "schedule tiny, pad 8, contexts across KV buckets" env MESHNODE_GPU_PAD_ROWS=8 "$PY" -m meshnode models \
    certify "$M/tiny.gguf" --schedule --gpu-layers all --contexts 200,240,480,600 --windows 2,4,8
fi
# Part 23: concurrent requests on a GPU node against the same requests alone
# (packaging/gpu/concurrent_probe.py): every held-out prompt alone, then all at once, on one
# node and on a 2-stage split of one GPU; the answers that differ are counted. First, at the
# engine (packaging/gpu/batch_probe.py), which groupings of sessions into calls are exact. Needs SmolLM2
# (/tmp/smol, carried like part 20).
if [ "$PART" = 23 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  # the split first (what was last seen to differ), then which of its stages changes an
  # answer: only stage 0 on the GPU, then only stage 1
  step 200 "concurrent requests against alone, 2 stages on one GPU" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2
  step 150 "concurrent requests against alone, 2 stages, stage 1 on CPU" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --peer-gpu-layers 0 --stages 2
  step 150 "concurrent requests against alone, 2 stages, stage 0 on CPU" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers 0 --peer-gpu-layers all --stages 2
  step 100 "concurrent requests against alone, one GPU node" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all
  [ -f "$M/tiny.gguf" ] || step 60 "write tiny" "$PY" "$KIT/mkmodels.py" tiny "$M/tiny.gguf"
  step 60 "batch groupings against alone, SmolLM2" "$PY" "$(dirname "$0")/batch_probe.py" "$SMOL"
fi
# Part 24: call shapes and CUDA graphs on a split (docs/engine.md "Call shapes and CUDA
# graphs"): certify --schedule with sticky 4-row calls (must stay exact), then the held-out
# run of part 21 (one round) without and with MESHNODE_GPU_STICKY_CALLS=32. Needs SmolLM2
# (/tmp/smol, carried like part 20); about 8 minutes. Part 25 (no SmolLM2, ~2 minutes, so
# it fits in the call that builds llama.cpp): a draft's proposals in calls of one shape
# (draft_probe: k = 1, 2, 3 drafts should cost about 1, 2 and 3 one-row steps) and engine
# call patterns (step_probe), on a random model of SmolLM2's shape. As run:
#   carry [.gpukit, .gpuwt/smol/part1]: . .gpukit/device-setup.sh && mkdir -p /tmp/smol &&
#     cp .gpuwt/smol/part1 /tmp/smol/ && bash packaging/gpu/measure.sh 25 "$OUT"
#   carry [.gpuwt/smol/part2], at once: (the exports of part 20); cp .gpuwt/smol/part2 /tmp/smol/ &&
#     bash packaging/gpu/measure.sh 24 "$OUT"
# The working tree travels with the carry (64 MiB in all); once it grew past ~3.5 MB the
# kit (16 MB) and part1 (47 MB) no longer fit one call, so the first call is split, each
# started at once after the one before: carry [.gpukit]: `. .gpukit/device-setup.sh`;
# carry [.gpuwt/smol/part1]: `test -d /tmp/site && mkdir -p /tmp/smol && cp .gpuwt/smol/part1 /tmp/smol/`.
if [ "$PART" = 24 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 120 "schedule SmolLM2 with sticky 4-row calls" env MESHNODE_GPU_STICKY_CALLS=32 "$PY" -m meshnode models \
    certify "$SMOL" --schedule --gpu-layers all --contexts 200,480 --windows 2,3,4
  for sticky in 0 32; do
    step 200 "bench spec SmolLM2 held-out, 2 stages on GPU 0, pad 2, sticky calls $sticky, 1 round" \
      env MESHNODE_GPU_STICKY_CALLS=$sticky CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
      --set heldout --tokens 96 --rounds 1 --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json
  done
fi
if [ "$PART" = 25 ]; then
  step 60 "draft proposals on the GPU, SmolLM2's shape" "$PY" "$(dirname "$0")/draft_probe.py" /tmp/smolshape.gguf --smol-shape
  step 30 "engine call patterns, pad 2" "$PY" "$(dirname "$0")/step_probe.py" /tmp/smolshape.gguf 2
  write_l8b
  step 60 "engine call patterns, 8b shape, pad 2" "$PY" "$(dirname "$0")/step_probe.py" "$M/l8b.gguf" 2
fi
# Part 26: the held-out run of part 24 with what each engine chose by timing itself at load
# (no MESHNODE_GPU_STICKY_CALLS: the default). Carried and chained like part 24.
if [ "$PART" = 26 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 200 "bench spec SmolLM2 held-out, 2 stages on GPU 0, pad 2, call shapes by timing, 1 round" \
    env -u MESHNODE_GPU_STICKY_CALLS CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
    --set heldout --tokens 96 --rounds 1 --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json
fi
# Part 27: the two checks a change to call shapes or drafting needs, in one call after part
# 25 (carried and chained like part 24, ~5 minutes): concurrent requests against alone on a
# 2-stage split of one GPU (every answer must equal its answer alone), certify --schedule
# at more contexts (the default call shapes: wide after windows), then part 26's held-out
# run.
if [ "$PART" = 27 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  # a difference is then attributed: the same check with small calls keeping their width
  step 200 "concurrent requests against alone, 2 stages on one GPU" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2 ||
    step 200 "concurrent requests against alone, 2 stages on one GPU, no wide calls" \
      env MESHNODE_GPU_STICKY_CALLS=0 "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2
  step 120 "schedule SmolLM2, wide calls after windows, more contexts" "$PY" -m meshnode models certify "$SMOL" \
    --schedule --gpu-layers all --contexts 60,130,300,600,700,1000,1500 --windows 2,3,4 ||
    step 120 "schedule SmolLM2, no wide calls, more contexts" env MESHNODE_GPU_STICKY_CALLS=0 "$PY" -m meshnode \
      models certify "$SMOL" --schedule --gpu-layers all --contexts 60,130,300,600,700,1000,1500 --windows 2,3,4
  step 200 "bench spec SmolLM2 held-out, 2 stages on GPU 0, pad 2, call shapes by timing, 1 round" \
    env -u MESHNODE_GPU_STICKY_CALLS CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
    --set heldout --tokens 96 --rounds 1 --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json
fi
# Part 28: where part 27's concurrent differences come from (2 of 29 answers on the split,
# first differences at tokens ~15-32 of two chats, one order only). At the engine, in one
# process (split_batch_probe.py): a split's two engines, eight sessions grouped at random
# against each alone, with the default call shapes, with windows, and with wide calls off;
# then the concurrent probe with wide calls off (in part 27 it ran out of time). On the
# H200 a schedule took ~20 s (3 per configuration fit the 80 s steps). Three calls, each
# at once after the one before (a call carries 64 MiB at most, the working tree included):
#   carry [.gpukit]: . .gpukit/device-setup.sh
#   carry [.gpuwt/smol/part1]: mkdir -p /tmp/smol && cp .gpuwt/smol/part1 /tmp/smol/
#   carry [.gpuwt/smol/part2]: (the exports of part 20); cp .gpuwt/smol/part2 /tmp/smol/ &&
#     bash packaging/gpu/measure.sh 28 "$OUT"
# Parts 26 and 27 run the same way (the last call with their number).
if [ "$PART" = 28 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  probe=("$PY" "$(dirname "$0")/split_batch_probe.py" "$SMOL")
  step 80 "split engines, sessions grouped at random, default call shapes" "${probe[@]}" --schedules ${MEASURE_SCHEDULES:-3}
  step 80 "split engines, sessions grouped at random, default call shapes, windows" "${probe[@]}" --windows --schedules ${MEASURE_SCHEDULES:-3}
  step 80 "split engines, sessions grouped at random, no wide calls, windows" \
    env MESHNODE_GPU_STICKY_CALLS=0 "${probe[@]}" --windows --schedules ${MEASURE_SCHEDULES:-3}
  step ${MEASURE_LEFT:-200} "concurrent requests against alone, 2 stages on one GPU, no wide calls" \
    env MESHNODE_GPU_STICKY_CALLS=0 "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2
fi
# Part 29: part 28's concurrent difference again (one answer, its first token, in both
# orders, wide calls off), now with the texts printed; then the same with --parallel 1
# (requests queued and served one at a time: a difference there would come from what ran
# before, not from sessions computed together). Carried and chained like part 24.
if [ "$PART" = 29 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  for par in 8 1; do
    step 120 "concurrent requests against alone, 2 stages on one GPU, no wide calls, --parallel $par" \
      env MESHNODE_GPU_STICKY_CALLS=0 "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all \
      --stages 2 --parallel $par
  done
fi
# Part 30: the concurrent probe after the fast-lane fix (a prompt's one-row last chunk
# overtook its earlier chunks), with the default call shapes, without speculation and with
# it (windows and wide calls beside other sessions): every answer must
# equal its answer alone; a difference is printed with any in-band error and the nodes'
# warnings (what part 27's two chats were is not known). Carried and chained like part 24.
if [ "$PART" = 30 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  for spec in off on; do
    step 150 "concurrent requests against alone, 2 stages on one GPU, --spec-mode $spec" \
      "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2 --spec-mode $spec
  done
fi
# Part 31: part 30 with --spec-mode on lost stage 1 twice mid-run ("peer vanished (no
# heartbeat)": no byte from it for 1.5 s, docs/mesh.md "Failure detection") and re-planned.
# The same run with asyncio's debug mode in every node (PYTHONASYNCIODEBUG=1: each callback
# that holds the event loop over 100 ms is logged with what it ran) and the nodes' whole
# logs kept in $OUT/logs31, to find what kept a stage silent. Carried and chained like part 24.
if [ "$PART" = 31 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 200 "concurrent requests against alone, 2 stages on one GPU, --spec-mode on, asyncio debug" \
    env PYTHONASYNCIODEBUG=1 "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all \
    --stages 2 --spec-mode on --logs "$OUT/logs31"
  step 150 "concurrent requests against alone, 2 stages on one GPU, --spec-mode on" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all \
    --stages 2 --spec-mode on --logs "$OUT/logs31b"
fi
# Part 32: where part 31's long steps went (asyncio's debug mode named the callbacks: stage
# 0's scheduler step and stage 1's lane step, 0.1-1.5 s each, the two nodes at once): the
# same run with the stall watch in every node (MESHNODE_STALL_MS=60, meshnode/stallwatch.py:
# the loop thread's Python stack while the loop is held over 60 ms), logs in $OUT/logs32.
# With GPU engines no longer moving sessions between KV streams, it checks that fix: no
# stall in StageEngine._pack, no "peer vanished". It also logs the CPUs and the cgroup's
# CPU quota (in the first run the watch thread itself could not sample for up to 0.8 s
# while the loop thread was inside llama.cpp calls, as if the whole process were held),
# then times a step after a session copy and a swap through host (copy_probe.py: on the
# 2-core VM 24.6 and 13.8 ms against a 19.0 ms step). The watch also says how much of each
# stall was garbage collection (the 83-100 ms stalls of the first run with the fix sat at
# frames that only allocate or send, as a full collection's do; nodes now freeze their
# start-up heap out of the collector). Carried and chained like part 24.
if [ "$PART" = 32 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  { echo "nproc $(nproc)"; cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null; } \
    | sed 's/^/host: /' >>"$LOG"
  step 150 "concurrent requests against alone, 2 stages on one GPU, --spec-mode on, stall watch" \
    env MESHNODE_STALL_MS=60 "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all \
    --stages 2 --spec-mode on --logs "$OUT/logs32"
  step 60 "what a session copy and a swap through host cost on the GPU" \
    "$PY" "$(dirname "$0")/copy_probe.py" "$SMOL" 1000
fi
# Part 33: the held-out run of part 26 at bench spec's own answer length (max_tokens 160,
# the figure docs/benchmarks.md quotes for the VM) instead of --tokens 96. Carried and
# chained like part 24 (~4 minutes in the last call; MEASURE_ROUNDS=2, ~7).
if [ "$PART" = 33 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 560 "bench spec SmolLM2 held-out, 2 stages on GPU 0, max_tokens 160, ${MEASURE_ROUNDS:-1} round(s)" \
    env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$SMOL" \
    --set heldout --rounds ${MEASURE_ROUNDS:-1} --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json
fi
# Part 34: what the CPU exactness checks of prompt scoring, prefix reuse and the repetition
# penalty say on a GPU (each exits 1 on a difference): bench score (scored prompts reusing a
# shared context against computing it whole: the same logprobs), bench prefix (an editor's
# sequence warm against cold: the same text), and bench spec's held-out quick set with
# repetition_penalty 1.1 against without (n-gram speculation's text against plain
# decoding's; the penalized steps' speed). Carried and chained like part 24 (~9 minutes).
if [ "$PART" = 34 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  gpu=(--model "$SMOL" --gpu-layers all --busy-poll --json)
  step 150 "bench score SmolLM2, 2 stages on GPU 0" env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench score "${gpu[@]}"
  step 150 "bench prefix SmolLM2, 2 stages on GPU 0, 1 round" \
    env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench prefix --rounds 1 "${gpu[@]}"
  for rp in "" 1.1; do
    step 130 "bench spec SmolLM2 held-out (quick), 2 stages on GPU 0, repetition_penalty ${rp:-none}" \
      env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --set heldout --quick --rounds 1 \
      --strategies baseline,ngram_auto ${rp:+--repetition-penalty $rp} "${gpu[@]}"
  done
fi
# Part 35: n > 1 on a GPU split (the choices share the prompt's KV up to a chunk boundary
# and each computes the last chunk, as one choice does): every held-out prompt alone, then
# with 2 greedy choices; each choice must be the answer alone. Carried and chained like
# part 24 (~2 minutes).
if [ "$PART" = 35 ]; then
  [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
  step 200 "2 greedy choices against the answer alone, 2 stages on one GPU" \
    "$PY" "$(dirname "$0")/concurrent_probe.py" --model "$SMOL" --gpu-layers all --stages 2 --choices 2
fi
# Part 36: a CPU node while its machine does other work (no GPU: CUDA hidden). bench
# engine on the 1B shape (Q4_0 and f16) with every logical CPU's thread or one per physical
# core, libgomp's default spin before a thread sleeps at a barrier or GOMP_SPINCOUNT 1000 /
# 3000, alone and beside 4 busy processes (--load 4). Needs no carried model (~6 minutes
# after the build).
if [ "$PART" = 36 ]; then
  "$PY" - >>"$LOG" 2>&1 <<'PY'
import glob, os
cores = {open(p).read().strip() for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/core_cpus_list")}
print(f"logical CPUs {os.cpu_count()}, physical cores {len(cores) or '?'}")
PY
  PHYS=$("$PY" -c "import glob; print(len({open(p).read() for p in glob.glob('/sys/devices/system/cpu/cpu[0-9]*/topology/core_cpus_list')}) or 1)")
  [ -f "$M/l1bq.gguf" ] || step 120 "write 1b Q4_0" "$PY" "$KIT/mkmodels.py" 1b "$M/l1bq.gguf" Q4_0
  [ -f "$M/l1b.gguf" ] || step 120 "write 1b f16" "$PY" "$KIT/mkmodels.py" 1b "$M/l1b.gguf"
  for model in l1bq l1b; do
    for threads in ${MEASURE_THREADS:-$(nproc) $PHYS}; do
      for spin in ${MEASURE_SPINS:-default 1000 3000}; do
        for load in 0 4; do
          envs=(CUDA_VISIBLE_DEVICES=)
          [ "$spin" = default ] || envs+=(GOMP_SPINCOUNT=$spin)
          step 90 "cpu contention $model threads $threads spin $spin load $load" env "${envs[@]}" \
            "$PY" -m meshnode bench engine "$M/$model.gguf" --gpu-layers 0 --splits 8 --threads "$threads" \
            --tokens 32 --warmup 4 --reps 1 --prefill 64 --windows none --gap-ms 0 --load $load --json
        done
      done
    done
  done
fi
# Part 37: a CPU node's thread count adapting to a busy machine (engine/threads.py; no GPU:
# CUDA hidden). bench engine --adapt on the 1B shape in Q4_0 with every logical CPU's
# thread: the whole model at that fixed count against a copy that adapts, token by token,
# alone and beside MEASURE_LOADS busy processes (default 0 4 8). Needs no carried model
# (~5 minutes after the build).
if [ "$PART" = 37 ]; then
  [ -f "$M/l1bq.gguf" ] || step 120 "write 1b Q4_0" "$PY" "$KIT/mkmodels.py" 1b "$M/l1bq.gguf" Q4_0
  for load in ${MEASURE_LOADS:-0 4 8}; do
    step 170 "adaptive threads l1bq threads $(nproc) load $load" env CUDA_VISIBLE_DEVICES= \
      "$PY" -m meshnode bench engine "$M/l1bq.gguf" --gpu-layers 0 --splits 8 --threads "$(nproc)" \
      --tokens ${MEASURE_TOKENS:-300} --warmup 4 --reps 1 --prefill 64 --windows none --gap-ms 0 \
      --load $load --adapt --json
  done
fi
# Part 38: the default model's weight type (Q8_0, docs/models.md "Default model") on a GPU.
# The GPU's window bound (4 rows at pad 2, spec/window.py) was measured on Q4_0 and f16
# weights; CUDA picks its matmul kernels by weight type too. certify --schedule on random
# models of SmolLM2's shape and of the 8B's width (8 layers) in Q8_0, written here (no
# carry beyond .gpukit); with SmolLM2's two halves carried (chained like part 24) also the
# real model's Q8_0 copy, then the held-out run of part 33 on it (the text must equal plain
# decoding's). ~4 minutes without SmolLM2 after the build, ~9 with it.
if [ "$PART" = 38 ]; then
  SMOLQ8=$M/smolshape-q8_0.gguf
  step 120 "write a SmolLM2-shaped random model in Q8_0" "$PY" - "$SMOLQ8" "$DRY" <<'PY'
import sys
from pathlib import Path
from meshnode.engine.quantize import requantize
from meshnode.models.synthetic import SyntheticSpec, write_synthetic_gguf
out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
if not out.exists():
    f16 = out.with_name(out.stem + "-f16.gguf")
    write_synthetic_gguf(f16, SyntheticSpec(
        architecture="llama", n_layer=4 if dry else 30, n_embd=576, n_head=9, n_kv_head=3,
        n_ff=1536, vocab=4096 if dry else 49152, dtype="f16", tied_embeddings=True,
        rope_freq_base=100000.0, rms_eps=1e-5, name="synthetic-smollm2-shape"))
    requantize(f16, out, "Q8_0", n_threads=4)
    f16.unlink()
print(out, out.stat().st_size)
PY
  schedule "$SMOLQ8" "SmolLM2 shape Q8_0, GPU defaults, windows 2-4" -- --windows 2,3,4 --json
  schedule "$SMOLQ8" "SmolLM2 shape Q8_0, GPU defaults, windows 5-8 (beyond the bound)" -- --windows 5,6,8 --json
  if [ "$DRY" = 1 ]; then
    L8Q8=$SMOLQ8
  else
    L8Q8=$M/l8b-8layers-q8_0.gguf
    [ -f "$L8Q8" ] || step 240 "write the 8B shape, 8 layers, Q8_0" env MK8B_LAYERS=8 "$PY" "$KIT/mkmodels.py" 8b "$L8Q8" Q8_0
  fi
  schedule "$L8Q8" "8B shape (8 layers) Q8_0, GPU defaults, windows 2-4" -- --windows 2,3,4 --json
  if [ -f "$SMOLDIR/part2" ] || [ -f "$SMOL" ]; then
    [ -f "$SMOL" ] || cat "$SMOLDIR"/part1 "$SMOLDIR"/part2 > "$SMOL"
    REALQ8=$SMOLDIR/SmolLM2-135M-Instruct.Q8_0.gguf
    [ -f "$REALQ8" ] || step 60 "SmolLM2 Q8_0 from the wheel's Q4_1 (as a node makes it)" "$PY" -c \
      "import sys; from meshnode.engine.quantize import requantize; requantize(sys.argv[1], sys.argv[2], 'Q8_0', n_threads=4)" \
      "$SMOL" "$REALQ8"
    schedule "$REALQ8" "SmolLM2 Q8_0, GPU defaults, windows 2-4" -- --windows 2,3,4 --json
    step 560 "bench spec SmolLM2 Q8_0 held-out, 2 stages on GPU 0, max_tokens 160, 1 round" \
      env CUDA_VISIBLE_DEVICES=0 "$PY" -m meshnode bench spec --model "$REALQ8" \
      --set heldout --rounds 1 --strategies baseline,ngram_auto,draft --gpu-layers all --busy-poll --json \
      $([ "$DRY" = 1 ] && echo --quick --tokens 8)
  fi
fi
grep "^===" "$LOG" > "$OUT/part$PART.summary"
