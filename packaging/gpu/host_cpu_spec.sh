#!/usr/bin/env bash
# Speculation on the lent machine's CPU (no GPU): `meshnode bench spec` on the held-out
# prompts, baseline against n-gram auto, a 2-stage split with the 5 ms relay, with a
# CPU-only build of llama.cpp. The device has no internet and a call carries at most 64 MiB
# (the checkout included), so SmolLM2's GGUF travels in three parts
# (`split -n 3 -d GGUF .devcpu/smol.`), one per call:
#
#   call 1, carry [.gpukit, .devcpu/smol.00]:  bash packaging/gpu/host_cpu_spec.sh build
#   call 2, carry [.devcpu/smol.01]:           bash packaging/gpu/host_cpu_spec.sh copy
#   call 3, carry [.devcpu/smol.02]:           bash packaging/gpu/host_cpu_spec.sh run "$OUT"
#
# (.gpukit: ../shared/gpu copied into the checkout; see its README.) Each call must follow
# the last within the machine's 30 s of warmth. THREADS (default 4) llama.cpp threads per stage; SETS (default
# "quick full") which runs: the --quick subset and/or the whole held-out half.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/site-cpu
SMOLDIR=/tmp/smolcpu
SMOL=$SMOLDIR/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$SMOLDIR"
for p in "$ROOT"/.devcpu/smol.0*; do [ -f "$p" ] && cp "$p" "$SMOLDIR"/; done
case "${1:?build, copy or run}" in
copy) ls -l "$SMOLDIR" ;;
build)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$ROOT"/.gpukit/wheels/*.whl || exit 1
  rm -rf /tmp/llsrc-cpu && mkdir -p /tmp/llsrc-cpu && tar xzf "$ROOT"/.gpukit/llama_cpp_python-0.3.36-stripped.tgz -C /tmp/llsrc-cpu
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONPATH=$SITE
  t0=$SECONDS
  CMAKE_ARGS="-DGGML_CUDA=off -DGGML_NATIVE=on -DLLAVA_BUILD=off" \
    python3 -m pip install --no-build-isolation --no-deps --no-compile --target "$SITE" /tmp/llsrc-cpu/* \
    > /tmp/llbuild-cpu.log 2>&1 || { tail -n 40 /tmp/llbuild-cpu.log; exit 1; }
  echo "built in $((SECONDS - t0)) s"
  PYTHONPATH=$SITE python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz" ;;
run)
  OUT=${2:?output folder}
  [ -f "$SMOL" ] || cat "$SMOLDIR"/smol.00 "$SMOLDIR"/smol.01 "$SMOLDIR"/smol.02 > "$SMOL"
  sha256sum "$SMOL" | cut -c1-16
  ip link set lo multicast on 2>/dev/null
  # without the system libstdc++ first, the first model load crashed there (as with CUDA)
  export LD_PRELOAD=$(ldconfig -p | grep 'libstdc++.so.6 ' | head -1 | awk '{print $NF}')
  export PYTHONPATH="$ROOT:$SITE" MESHNODE_KEYRING=file MESHNODE_HOME=/tmp/cpuhome PYTHONUNBUFFERED=1
  THREADS=${THREADS:-4}
  for set in ${SETS:-quick full}; do
    flag=; [ "$set" = quick ] && flag=--quick
    echo "=== bench spec held-out ($set), --threads $THREADS"
    timeout "${LIMIT:-420}" python3 -m meshnode bench spec --model "$SMOL" $flag --set heldout \
      --strategies baseline,ngram_auto --threads "$THREADS" --pin --json > "$OUT/spec-$set-t$THREADS.txt" 2>&1
    echo "rc=$?"; grep -v '^{' "$OUT/spec-$set-t$THREADS.txt" | tail -n 25
  done ;;
esac
