#!/usr/bin/env bash
# The FP8 speed matrix (issue 45) on a lent GPU machine with no network, in one or more calls on the same
# warm machine. The vLLM 0.26.0 bundle (../shared/tools/vllm-bundle.sh) must already be unpacked into
# /tmp/vllm-site. Usage there, from the repo root:
#   bash bench/speed_device.sh OUT BUDGET_S     # builds the checkpoints once, then serves what is not measured yet
# Engines load N at once (4 on a card of > 100 GB, else 2) and are each timed alone (bench/speed.py --parallel);
# /dev/shm/speed-out/speed.json keeps what earlier calls measured, and is copied to OUT after every call.
set -uo pipefail
out=${1:?OUT}; budget=${2:-300}
export PYTHONPATH=/tmp/vllm-site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/machine.txt"
python3 -c "import sys, torch, vllm; print(sys.version.split()[0], torch.__version__, torch.version.cuda, vllm.__version__)" \
  2>/dev/null | tee -a "$out/machine.txt"
if [ ! -f /dev/shm/speed/.built ]; then
  python3 -m bench.speed build --work /dev/shm/speed --models target-bf16,target-w4a16,target-fp8,drafter-bf16,drafter-w4a16,drafter-fp8,drafter-fp8-dynamic,drafter-fp8-head32k \
    > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  touch /dev/shm/speed/.built
fi
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
par=2; [ "$mib" -gt 100000 ] && par=4
# the matrix (bench/speed.py FP8_MATRIX) in waves of four, the rows no earlier run measured in the second wave: the
# targets alone; the W4A16 drafter beside FP8, fp8-dynamic, the 32k-head FP8 drafter; the bf16 drafter beside
# each target; the FP8 drafter beside each target; then the W4A16 drafters
ORDER=bf16/-,fp8/-,w4a16-marlin/-,w4a16/-
ORDER=$ORDER,fp8/w4a16-marlin/k15,bf16/fp8-dynamic/k15,fp8/fp8-head32k/k15,w4a16-marlin/fp8-head32k/k15
ORDER=$ORDER,bf16/bf16/k15,fp8/bf16/k15,w4a16-marlin/bf16/k15,w4a16/bf16/k15
ORDER=$ORDER,bf16/fp8/k15,fp8/fp8/k15,w4a16-marlin/fp8/k15,w4a16/fp8/k15
ORDER=$ORDER,bf16/w4a16-marlin/k15,w4a16/w4a16-marlin/k15,w4a16/w4a16/k15
ORDER=${SPEED_ORDER:-$ORDER}  # another order (the same names) where engines load two at a time
python3 -m bench.speed run --work /dev/shm/speed --out /dev/shm/speed-out --budget-s "$budget" --only "$ORDER" \
  --parallel "$par" 2>&1 | tee -a "$out/run.log" | grep '^\[speed\]'
rc=$?
cp /dev/shm/speed-out/speed.json "$out/" 2>/dev/null
exit $rc
