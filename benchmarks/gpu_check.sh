#!/usr/bin/env bash
# benchmarks/gpu_check.sh: rlfoundry's checks on one CUDA GPU (H100 / H200): about 5 minutes, at most
# 7.5 (the parts' time limits, 415 s, plus the wheel install).
#
# What it runs, each part under its own `timeout` (a hang in one part loses none of the others):
#   env       nvidia-smi; Python, torch, transformers and the other versions; every import the parts need
#             (rlfoundry without Ray), a bf16 matrix product on the GPU, NCCL available
#   train     `python -m rlfoundry train` on CUDA, trainer.worker_backend=process (no Ray): the default
#             GRPO job (packaged tiny policy, synthetic arithmetic task, 40 steps, validation every 10,
#             checkpoints at 20 and 40); FSDP2 with fp32 master weights computing in bf16 (the CUDA
#             default); prints val-core/.../reward/mean@1 first -> last (53 % -> ~98 % on the CPU)
#   bench     `python -m benchmarks.realistic --device cuda`: rlfoundry (verl's keys only) vs TRL at
#             Qwen2.5-0.5B's layer shape, 24 layers, 8 prompts x 8 samples, 128-token responses, bf16
#             compute; MFU of the update against the GPU's bf16 matmul peak measured in the same run
#   offload   the train job with actor_rollout_ref.actor.fsdp_config.param_offload=true and
#             optimizer_offload=true (CPUOffloadPolicy + optimizer state on the host), 10 steps
#
# Run from the repository root:
#     bash benchmarks/gpu_check.sh                # results in $OUT (the device tool's), else /tmp/gpu_check
# On the project's device tool, with the missing packages carried as wheels in .whl/ (git-ignored;
# tensordict, hydra-core, omegaconf, antlr4, datasets, torchdata, math-verify, pydantic, trl, ...):
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480)
# The wheels are installed with pip --target /tmp/site (nothing on the machine changes); no Ray is
# needed (the process / local worker back ends). Nothing reads ../shared: the train job writes its
# data, the benchmark builds its model and data under $WORK.
#
# Knobs (environment): PYTHON (python3), OUT, WORK (/tmp/gpu_check_work), GPU_CHECK_DEVICE (cuda; cpu
# for a dry run of the commands), GPU_CHECK_QUICK=1 (tiny sizes, for that dry run), GPU_CHECK_SKIP_WHEELS=1,
# GPU_CHECK_PARTS ("env train bench offload"), T_ENV / T_TRAIN / T_BENCH / T_OFFLOAD (seconds per part).
#
# Files left in $OUT (at most 8): summary.txt, env.log, train.log, bench.log, offload.log,
# realistic_cuda.json (the benchmark's result file), extras.tar.gz (the runs' metrics.jsonl and the
# benchmark's per-run logs and result files).

set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
QUICK=${GPU_CHECK_QUICK:-0}
PARTS=${GPU_CHECK_PARTS:-env train bench offload}
T_ENV=${T_ENV:-45} T_TRAIN=${T_TRAIN:-90} T_BENCH=${T_BENCH:-260} T_OFFLOAD=${T_OFFLOAD:-60}
mkdir -p "$OUT" "$WORK"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
START=$SECONDS

say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }

# ── packages: the carried wheels go to /tmp/site, ahead of the machine's own on the path ──────────
export PYTHONPATH=$REPO
if [ "${GPU_CHECK_SKIP_WHEELS:-0}" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl > "$WORK/pip.log" 2>&1; then
        export PYTHONPATH=/tmp/site:$REPO
        say "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    else
        say "WHEEL INSTALL FAILED (going on with the machine's packages):"; tail -20 "$WORK/pip.log" | tee -a "$SUMMARY"
    fi
fi
export PYTHON DEVICE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TRANSFORMERS_VERBOSITY=error WANDB_DISABLED=true

# part NAME SECONDS CMD...: run CMD under `timeout`, its output to the console and $OUT/NAME.log
part() {
    local name=$1 limit=$2; shift 2
    case " $PARTS " in *" $name "*) ;; *) say "$name: skipped (GPU_CHECK_PARTS)"; return 0 ;; esac
    local t0=$SECONDS
    say "$name: start (limit ${limit}s): $*"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict="exit $rc"
    [ "$rc" = 0 ] && verdict=ok
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && verdict="TIMED OUT after ${limit}s"
    say "$name: $verdict in $((SECONDS - t0))s"
    return 0
}

if [ "$QUICK" = 1 ]; then
    TRAIN_STEPS=4 TEST_FREQ=2 OFFLOAD_STEPS=2
    BENCH_ARGS=(--layers 1 --response-lengths 8 --prompts-per-step 2 --n 2 --steps 2 --repeats 1 --threads 2)
else
    TRAIN_STEPS=40 TEST_FREQ=10 OFFLOAD_STEPS=10
    # a fresh GPU process's first steps are 2-3x slower (kernel selection, allocator growth): 4 of 8 timed
    BENCH_ARGS=(--layers 24 --response-lengths 128 --prompts-per-step 8 --n 8 --steps 8 --warmup-steps 4 --repeats 1 --threads 8)
fi
TRAIN_KEYS=(trainer.device="$DEVICE" trainer.worker_backend=process trainer.n_gpus_per_node=1
            trainer.resume_mode=disable trainer.save_freq=20)

# ── env ──────────────────────────────────────────────────────────────────────────────────────────
env_check() {
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
        --format=csv || echo "no nvidia-smi"
    echo "PYTHONPATH=$PYTHONPATH"
    "$PYTHON" - "$DEVICE" <<'EOF'
import importlib, sys, time
from importlib import metadata
device = sys.argv[1]
print("python", sys.version.split()[0], sys.executable)
names = ["torch", "transformers", "accelerate", "peft", "tokenizers", "safetensors", "numpy", "pyarrow", "pandas",
         "fsspec", "huggingface-hub", "typing_extensions", "tensordict", "pyvers", "hydra-core", "omegaconf",
         "antlr4-python3-runtime", "datasets", "dill", "multiprocess", "torchdata", "math-verify",
         "latex2sympy2_extended", "pydantic", "pydantic_core", "trl", "ray", "psutil", "cloudpickle"]
for n in names:
    try:
        print(f"  {n:24s} {metadata.version(n)}")
    except metadata.PackageNotFoundError:
        print(f"  {n:24s} -")
failed = []
for mod in ["torch", "transformers", "tensordict", "hydra", "omegaconf", "torchdata.stateful_dataloader",
            "math_verify", "pydantic", "datasets", "trl", "rlfoundry.protocol", "rlfoundry.trainer.main_ppo",
            "rlfoundry.workers.fsdp_workers", "rlfoundry.rewards.math", "benchmarks.realistic"]:
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - report every failing import, not the first
        failed.append(mod)
        print(f"IMPORT FAILED {mod}: {type(e).__name__}: {e}")
print("ray imported by rlfoundry:", "ray" in sys.modules)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if device == "cuda":
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB",
          "bf16", torch.cuda.is_bf16_supported(), "nccl", torch.distributed.is_nccl_available())
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
    print(f"bf16 4096^3 matmul: {20 * 2 * 4096**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
sys.exit(1 if failed else 0)
EOF
}
# timeout runs programs, not shell functions
{ declare -f env_check; echo env_check; } > "$WORK/env_check.sh"
part env "$T_ENV" bash "$WORK/env_check.sh"

# ── train: the default GRPO job on the GPU, process back end ────────────────────────────────────
rm -rf "$WORK/train" "$WORK/offload"
part train "$T_TRAIN" "$PYTHON" -m rlfoundry train "${TRAIN_KEYS[@]}" \
    trainer.total_training_steps=$TRAIN_STEPS trainer.test_freq=$TEST_FREQ \
    trainer.experiment_name=gpu-check-train trainer.default_local_dir="$WORK/train"

# ── bench: rlfoundry vs TRL, bf16 on the GPU ────────────────────────────────────────────────────
rm -rf "$WORK/bench/runs"
part bench "$T_BENCH" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" \
    --timeout $(((T_BENCH - 50) / 2)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_$DEVICE"

# ── offload: parameters and optimizer state on the host between uses ────────────────────────────
part offload "$T_OFFLOAD" "$PYTHON" -m rlfoundry train "${TRAIN_KEYS[@]}" \
    actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    trainer.total_training_steps=$OFFLOAD_STEPS trainer.test_freq=$((OFFLOAD_STEPS / 2)) \
    trainer.experiment_name=gpu-check-offload trainer.default_local_dir="$WORK/offload"

# ── results ─────────────────────────────────────────────────────────────────────────────────────
for name in train offload; do
    [ -f "$OUT/$name.log" ] && grep -a -E "finished at step|val-core|Traceback|Error" "$OUT/$name.log" \
        | tail -8 | sed "s/^/  $name: /" | tee -a "$SUMMARY"
done
[ -f "$OUT/bench.log" ] && grep -a -v -E "Loading weights|Writing model shards" "$OUT/bench.log" \
    | grep -a -A12 -E "^machine:|^== |Traceback" | sed 's/^/  bench: /' | tee -a "$SUMMARY"
(cd "$WORK" && tar czf "$OUT/extras.tar.gz" --ignore-failed-read --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.distcp' --exclude='*.png' --exclude='*.html' --exclude='checkpoints' --exclude='data' pip.log train/metrics.jsonl offload/metrics.jsonl \
    bench/runs 2> /dev/null || true)
say "done in $((SECONDS - START))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
