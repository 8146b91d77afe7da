#!/usr/bin/env bash
# One-GPU throughput in one call (under 8 minutes on one H200): the plain-PyTorch compiled Llama ceiling, then
# meshforge at world size 1 with ddp, fsdp2 and megatron_fsdp (bf16 autocast, regional compile, fused loss where
# it applies (auto: not under megatron_fsdp's default optim_grads_params), FP8
# tensorwise) and fsdp2 without FP8 with bf16 parameters (training.precision=bf16_params: no autocast, fp32
# master weights), at the llama3_2_1b shape, seq 4096, micro batch 4; prints one table with tokens/s, TFLOP/s,
# MFU, peak GiB and each row's ratio to the ceiling (also written to $OUT_DIR/table.md), then one line naming
# the SDPA kernel the model's attention ran at that shape (flash / cudnn / efficient / math).
#
# The GPU machine has no package registry: what meshforge needs beyond torch comes from a wheel folder
# ($MESHFORGE_WHEELS, default benchmarks/.wheels, made here by benchmarks/gpu_wheels.sh and carried along),
# installed with --no-deps --no-index into a private folder on PYTHONPATH; nothing is installed system-wide.
#
#   benchmarks/gpu_throughput.sh           # the GPU run
#   benchmarks/gpu_throughput.sh --tiny    # the same steps end to end on CPU at a tiny shape (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT_DIR:-runs/gpu_throughput}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

# --- bring the missing dependencies (module -> wheel name prefix)
WHEELS=${MESHFORGE_WHEELS:-benchmarks/.wheels}
SITE="$ROOT/$OUT_DIR/site"
missing=()
for pair in pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types \
            typing_inspection:typing_inspection typing_extensions:typing_extensions yaml:PyYAML:pyyaml \
            rich:rich markdown_it:markdown_it_py mdurl:mdurl pygments:pygments safetensors:safetensors \
            numpy:numpy torchao:torchao; do
  mod=${pair%%:*}
  python -c "import $mod" 2>/dev/null && continue
  for prefix in $(echo "${pair#*:}" | tr ':' ' '); do
    for w in "$WHEELS"/"$prefix"-*.whl; do [ -e "$w" ] && missing+=("$w"); done
  done
done
if [ ${#missing[@]} -gt 0 ]; then
  python -m pip install --quiet --no-deps --no-index --target "$SITE" "${missing[@]}"
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
python -c "import pydantic, yaml, rich, safetensors, numpy" || {
  echo "gpu_throughput.sh: meshforge's dependencies are missing and $WHEELS lacks their wheels: run benchmarks/gpu_wheels.sh where pip can download" >&2
  exit 2; }

# --- the shape
if [ "${1:-}" = "--tiny" ]; then  # CPU end to end: tiny model, fp32, compile auto (= off on CPU), fp8 on every linear
  PRESET=tiny SEQ=32 MB=2 STEPS=2 WARMUP=1 LIMIT=300 DEVICE=cpu
  SHAPE=(model.preset=tiny training.seq_len=32 training.micro_batch_size=2 training.global_batch_size=2
         training.precision=fp32 training.device=cpu training.fp8.filter=all)
else
  python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_throughput.sh: no CUDA device is visible (use --tiny for the CPU check)" >&2; exit 2; }
  PRESET=llama3_2_1b SEQ=4096 MB=4 STEPS=10 WARMUP=3 LIMIT=1 DEVICE=cuda
  SHAPE=(training.seq_len=4096 training.micro_batch_size=4 training.global_batch_size=4 training.precision=bf16
         training.device=cuda training.compile=true)
fi
COMMON=(examples/llama3_2_1b.yaml "${SHAPE[@]}" training.fused_loss=auto checkpoint.interval=0
        checkpoint.resume=none)
FLAGS=(--nproc-per-node 1 --steps "$STEPS" --warmup "$WARMUP")

# --- 1. the ceiling (~90 s: whole-model compile), 2. meshforge with FP8 (3 configurations), 3. fsdp2 without FP8
# and with bf16 parameters, 4. the SDPA kernel (one block, seconds)
timeout $((140 * LIMIT)) python benchmarks/llama_ceiling.py --preset "$PRESET" --seq-len "$SEQ" \
  --micro-batch "$MB" --steps "$STEPS" --warmup "$WARMUP" --out "$OUT_DIR/ceiling.json"
rc=0
timeout $((230 * LIMIT)) python -m meshforge bench "${COMMON[@]}" training.fp8.enabled=true "${FLAGS[@]}" \
  --sweep distributed.strategy=ddp,fsdp2,megatron_fsdp --timeout 110 --output-dir "$OUT_DIR/fp8" || rc=$?
timeout $((80 * LIMIT)) python -m meshforge bench "${COMMON[@]}" training.fp8.enabled=false "${FLAGS[@]}" \
  training.precision=bf16_params --sweep distributed.strategy=fsdp2 --timeout 75 --output-dir "$OUT_DIR/bf16" || rc=$?
SDPA_LINE=$(timeout $((30 * LIMIT)) python -m meshforge.bench.sdpa --preset "$PRESET" --seq-len "$SEQ" --batch "$MB" \
  --device "$DEVICE" 2>&1 | tail -n 1) || rc=$?
echo
python benchmarks/gpu_table.py "$OUT_DIR/ceiling.json" "fp8=$OUT_DIR/fp8/bench.json" \
  "no-fp8 bf16_params=$OUT_DIR/bf16/bench.json" --markdown "$OUT_DIR/table.md"
echo "$SDPA_LINE" | tee -a "$OUT_DIR/table.md"
exit $rc
