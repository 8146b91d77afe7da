#!/usr/bin/env bash
# One-GPU throughput table: the llama3_2_1b preset at seq 4096, micro batch 4, bf16, for ddp, fsdp2 and
# megatron_fsdp at world size 1, plus the bare-PyTorch baseline; prints the table and writes
# bench.json / bench.md / bench.png under $OUT_DIR. Budget: under 8 minutes on one H200
# (about 45 s per configuration: start, 1.2B-parameter init, 3 warm-up + 10 timed steps; ~90 s baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_single.sh: no CUDA device is visible; this benchmark needs one GPU" >&2
  exit 2
fi
OUT_DIR=${OUT_DIR:-runs/bench_gpu_single}
# global batch = micro batch at world size 1: one forward/backward per step, no accumulation
exec timeout 470 meshforge bench examples/llama3_2_1b.yaml \
  training.seq_len=4096 training.micro_batch_size=4 training.global_batch_size=4 \
  training.precision=bf16 training.device=cuda checkpoint.interval=0 checkpoint.resume=none \
  --nproc-per-node 1 --steps 10 --warmup 3 \
  --sweep distributed.strategy=ddp,fsdp2,megatron_fsdp \
  --baseline --baseline-rounds 1 --timeout 150 \
  --output-dir "$OUT_DIR" "$@"
