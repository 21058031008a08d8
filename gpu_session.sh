#!/bin/bash
# One device session: gpu_check's multi-rank items (and the new ones), then an injected hang and
# crash over NCCL (the watchdog's device path). Usage: bash gpu_session.sh OUT [tiny|cpu]
OUT=$1; SIZE=${2:-tiny}
if [ "$SIZE" = cpu ]; then
  MODEL="--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 127"
  CHECK=""
else
  MODEL="--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size 1024"
  ITEMS=environment,1f1b-control,bitpipe-pp4,bitpipe-split-pp4,bitpipe-pp2-dp2-distopt,bert-bitpipe-pp4,bitpipe-pp4-bf16,zbv-pp4,dualpipev-pp4,dualpipev-pp4-layout,moe-bitpipe-pp2-ep2,optimus2d-q2
  timeout 400 python3 scripts/gpu_check.py --out "$OUT" --items $ITEMS --budget-s 380 > "$OUT/console.txt" 2>&1
  echo "gpu_check exit $?"; tail -20 "$OUT/console.txt"
fi
COMMON="$MODEL --micro-batch-size 2 --global-batch-size 16 --seed 1234 --lr 1e-3 --eval-iters 0 --log-interval 1 --train-iters 6"
for fault in hang crash; do
  start=$(date +%s.%N)
  NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
    scripts/gpu_rank.py --nccl-hostid-per-rank scripts/pretrain_gpt.py $COMMON --pipeline-schedule bitpipe \
    --pipeline-model-parallel-size 4 --inject-fault $fault --inject-fault-rank 1 --inject-fault-iteration 3 \
    --distributed-timeout-minutes 0.25 > "$OUT/fault_$fault.log" 2>&1
  rc=$?; end=$(date +%s.%N)
  echo "fault $fault: exit $rc after $(python3 -c "print(round($end-$start,1))") s"
  grep -m3 "watchdog:\|injected\|inject" "$OUT/fault_$fault.log"
done
