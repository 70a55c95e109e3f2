#!/usr/bin/env bash
# usage: bench_one.sh old|new|merge TAG   -> one bench run under the exclusive CPU lock
set -u
side=$1; tag=$2
case $side in
  old) dir=/work/scratch/oldbench/old; extra=();;
  merge) dir=/work/scratch/oldbench/merge; extra=();;
  new) dir=/work/wt/oldbench; extra=(--kernels ort);;
esac
out=/work/scratch/oldbench/runs/$tag
cd $dir
echo "$(date -u +%T) start $tag ($side @ $(git rev-parse --short HEAD))"
/work/bin/quiet /usr/bin/time -f "wall %e s, peak %M KB" .venv/bin/mirrorsd bench --model /work/scratch/oldbench/qwen-old \
  --questions /work/shared/data/spec_bench/question.jsonl --modes ar,sd,mirror --per-category 1 --max-new-tokens 64 \
  --threads 1 "${extra[@]}" --output $out > /work/scratch/oldbench/runs/$tag.log 2>&1
echo "$(date -u +%T) end $tag rc=$?"; tail -1 /work/scratch/oldbench/runs/$tag.log
