#!/usr/bin/env bash
# scripts/gpu_check.sh: every rlfoundry feature on one CUDA GPU (H100 / H200), one command, about 7
# minutes on an H100 (the default parts' limits, 30 + 200 + 70 + 220 = 520 s, plus the wheel install,
# bound a run that goes wrong; the tier's limit leaves room for the cold compiles of its newest tests).
#
#     bash scripts/gpu_check.sh [OUT_DIR]          # results in OUT_DIR, else $OUT (the device tool's), else /tmp/gpu_check
#     bash scripts/gpu_check.sh --dry-run [OUT_DIR] # the same commands on the CPU at tiny sizes (tests/scripts runs it)
#
# On the project's device tool, with the packages the GPU image lacks carried as wheels (made here by
# `bash scripts/gpu_wheels.sh`, into the git-ignored .whl/):
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)
# The wheels are installed with pip --target into $WORK/site, ahead of the machine's own packages on the
# path; nothing on the machine changes, no network and no Ray are needed.
#
# Parts, each under its own `timeout` (a hang in one loses none of the others):
#   env    nvidia-smi, Python and package versions, every import the parts need, a bf16 matmul, NCCL
#   tier   the GPU tier: `pytest -m gpu` over every test file that marks tests `gpu` (tests/gpu/, ...):
#          the default GRPO job learns, PPO with a critic saves and resumes, bf16 vs fp32 log-probs,
#          offload, LoRA, a real CUDA OOM, the calculator demo, code rewards, dynamic sampling,
#          rollout correction, one-step-off and fully async on one GPU, each ending cleanly
#   demo   `rlfoundry train --config-name calculator_grpo` on CUDA, process back end, 10 steps
#   bench  `python -m benchmarks.realistic --device cuda` (issue 34's shape: 24 layers, 128 tokens, 8 x 8)
#   dynamic  (not in the default parts) rlfoundry alone on the same shape with the rollout's dynamic,
#          uncompiled decode (rollout.use_torch_compile=false), to set beside bench's compiled one
#   vocab  (not in the default parts) bench's two frameworks with the real 151,936-token vocabulary
#   fused  (not in the default parts) rlfoundry alone on vocab's shape with model.use_fused_kernels=true
#          (log-probs from hidden states in chunks), to set beside vocab's logits path
#   wrapped  (not in the default parts) rlfoundry alone on bench's shape with fsdp_config.single_rank=fsdp
#          (the actor FSDP2-wrapped on one GPU, as before 2026-11-27), to set beside bench's plain module
#   large  (not in the default parts: a run of its own, `GPU_CHECK_PARTS="env large"`, estimated 3-4 minutes on an
#          H200, never run yet) `python -m benchmarks.large_shape`: Qwen2.5-7B's shape with LoRA and Qwen2.5-3B's
#          fully fine-tuned with optimizer offload, random bf16 weights made on the GPU, 4 GRPO steps each:
#          tokens/s, MFU and peak memory beside the planner's prediction (issue 49 item 5)
#
# Files left in OUT (the device tool returns at most 8): summary.txt (one line per part: PASS/FAIL, time,
# figures; then RESULT), summary.json, env.log, tier.log, demo.log, bench.log, realistic_<device>.json,
# extras.tar.gz (the tier's JUnit report, the demo's metrics, the benchmark's per-run logs); a `large`
# part adds large.log and large_<device>.json (each run's steps, the plan and the ratios).
# Exit status: 0 when every part passed.
#
# Knobs (environment): PYTHON (python3), WORK (/tmp/gpu_check_work), GPU_CHECK_WHEELS (.whl),
# GPU_CHECK_PARTS ("env tier demo bench"; also "dynamic", "vocab", "fused", "wrapped", "hfgen", "large"), T_ENV / T_TIER /
# T_DEMO / T_BENCH / T_DYNAMIC / T_VOCAB / T_FUSED / T_WRAPPED / T_HFGEN / T_LARGE (seconds per part), BENCH_STEPS / BENCH_WARMUP (6 / 3),
# LARGE_STEPS (4, the first a warm-up), TIER_WORKERS (pytest-xdist processes for the tier where
# pytest-xdist is installed, as on the GPU image: 4; the tests' runs are small and the card is shared).

set -u -o pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${1:-${OUT:-/tmp/gpu_check}}
WORK=${WORK:-/tmp/gpu_check_work}
PYTHON=${PYTHON:-python3}
PARTS=${GPU_CHECK_PARTS:-env tier demo bench}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    T_ENV=${T_ENV:-60} T_TIER=${T_TIER:-120} T_DEMO=${T_DEMO:-180} T_BENCH=${T_BENCH:-240}
    T_DYNAMIC=${T_DYNAMIC:-120} T_VOCAB=${T_VOCAB:-240} T_FUSED=${T_FUSED:-120} T_WRAPPED=${T_WRAPPED:-120}
    T_HFGEN=${T_HFGEN:-120} T_LARGE=${T_LARGE:-240}
else
    DEVICE=cuda
    T_ENV=${T_ENV:-30} T_TIER=${T_TIER:-200} T_DEMO=${T_DEMO:-70} T_BENCH=${T_BENCH:-220}
    T_DYNAMIC=${T_DYNAMIC:-150} T_VOCAB=${T_VOCAB:-240} T_FUSED=${T_FUSED:-150} T_WRAPPED=${T_WRAPPED:-150}
    T_HFGEN=${T_HFGEN:-180} T_LARGE=${T_LARGE:-480}
fi
mkdir -p "$OUT" "$WORK"
rm -f "$WORK/parts.tsv" "$WORK/tier.xml" "$OUT/summary.txt" "$OUT/summary.json"
SUMMARY=$OUT/summary.txt
START=$SECONDS
say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }
say "device $DEVICE$([ "$DRY" = 1 ] && echo ' (dry run: tiny sizes)'), parts: $PARTS, output in $OUT"

# ── packages: carried wheels go to $WORK/site, ahead of the machine's own on the path ───────────────
export PYTHONPATH=$REPO
if [ "$DRY" = 0 ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "$WHEELS"/*.whl > "$WORK/pip.log" 2>&1; then
        export PYTHONPATH=$WORK/site:$REPO
        say "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $WORK/site"
    else
        say "WHEEL INSTALL FAILED (going on with the machine's packages):"; tail -20 "$WORK/pip.log" | tee -a "$SUMMARY"
    fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TRANSFORMERS_VERBOSITY=error WANDB_DISABLED=true

# part NAME SECONDS CMD...: CMD under `timeout`, its output to the console and OUT/NAME.log; the exit
# code and time go to WORK/parts.tsv for the report
part() {
    local name=$1 limit=$2; shift 2
    case " $PARTS " in *" $name "*) ;; *) say "$name: skipped (GPU_CHECK_PARTS)"; return 0 ;; esac
    local t0=$SECONDS
    say "$name: start (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -5 "$OUT/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$WORK/parts.tsv"
    say "$name: exit $rc in $((SECONDS - t0))s"
}

# ── env ──────────────────────────────────────────────────────────────────────────────────────────
part env "$T_ENV" "$PYTHON" - "$DEVICE" <<'EOF'
import importlib, subprocess, sys, time
from importlib import metadata
device = sys.argv[1]
if device == "cuda":
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], check=False)
print("python", sys.version.split()[0], sys.executable)
for n in ["torch", "transformers", "accelerate", "peft", "tokenizers", "safetensors", "numpy", "pyarrow", "datasets",
          "tensordict", "hydra-core", "omegaconf", "torchdata", "math-verify", "pydantic", "pyseccomp", "trl", "pytest",
          "megatron-core", "mbridge", "ray", "pytest-xdist", "liger-kernel", "triton"]:
    try:
        print(f"  {n:16s} {metadata.version(n)}")
    except metadata.PackageNotFoundError:
        print(f"  {n:16s} -")
failed = []
for mod in ["torch", "transformers", "peft", "tensordict", "hydra", "omegaconf", "torchdata.stateful_dataloader",
            "math_verify", "pydantic", "datasets", "pytest", "trl", "rlfoundry.protocol", "rlfoundry.trainer.main_ppo",
            "rlfoundry.workers.actor_rollout_ref", "rlfoundry.rewards.code", "benchmarks.realistic",
            "benchmarks.large_shape"]:
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - report every failing import, not the first
        failed.append(mod)
        print(f"IMPORT FAILED {mod}: {type(e).__name__}: {e}")
print("ray imported by rlfoundry:", "ray" in sys.modules)
import ctypes.util, shutil
print("code sandbox: libseccomp", ctypes.util.find_library("seccomp") or "NOT FOUND", "| bwrap",
      shutil.which("bwrap") or "not found (the unshare backend is used)")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if device == "cuda":
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB",
          "bf16", torch.cuda.is_bf16_supported(), "nccl", torch.distributed.is_nccl_available())
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        y = x @ x
    torch.cuda.synchronize()
    print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
sys.exit(1 if failed else 0)
EOF

# ── tier: every test marked gpu ──────────────────────────────────────────────────────────────────
mapfile -t TIER_FILES < <(grep -rlE "^(@pytest\.mark\.gpu|pytestmark = .*pytest\.mark\.gpu)" tests --include='test_*.py' | sort)
TIER_XDIST=()
if "$PYTHON" -c "import xdist" 2> /dev/null; then TIER_XDIST=(-n "${TIER_WORKERS:-4}"); fi
part tier "$T_TIER" "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu -rfEs --durations=0 --junitxml="$WORK/tier.xml" \
    "${TIER_XDIST[@]}" "${TIER_FILES[@]}"

# ── demo: the calculator agent on CUDA, process back end ───────────────────────────────────────────
if [ "$DRY" = 1 ]; then
    DEMO_KEYS=(trainer.total_training_steps=1 trainer.test_freq=1 data.synthetic.val_size=4 data.train_batch_size=2
               actor_rollout_ref.rollout.n=2 actor_rollout_ref.actor.ppo_mini_batch_size=2
               actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 data.max_response_length=96)
else
    DEMO_KEYS=(trainer.total_training_steps=10 trainer.test_freq=5)
fi
rm -rf "$WORK/demo"
part demo "$T_DEMO" "$PYTHON" -m rlfoundry train --config-name calculator_grpo trainer.device="$DEVICE" \
    trainer.worker_backend=process trainer.n_gpus_per_node=1 trainer.resume_mode=disable trainer.save_freq=-1 \
    trainer.logger=file reward_model.reward_kwargs.num_workers=0 trainer.default_local_dir="$WORK/demo" "${DEMO_KEYS[@]}"

# ── bench: rlfoundry vs TRL, bf16 on the GPU (issue 34's workload) ────────────────────────────────
if [ "$DRY" = 1 ]; then
    BENCH_ARGS=(--layers 1 --response-lengths 4 --prompts-per-step 2 --n 2 --steps 1 --warmup-steps 0 --repeats 1 --threads 1)
else
    BENCH_ARGS=(--layers 24 --response-lengths 128 --prompts-per-step 8 --n 8 --steps "${BENCH_STEPS:-6}"
                --warmup-steps "${BENCH_WARMUP:-3}" --repeats 1 --threads 8)
fi
rm -rf "$WORK/bench/runs"
part bench "$T_BENCH" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" \
    --timeout $(((T_BENCH - 30) / 2)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_$DEVICE"
part dynamic "$T_DYNAMIC" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" --frameworks rlfoundry \
    --rlfoundry-override actor_rollout_ref.rollout.use_torch_compile=false \
    --timeout $((T_DYNAMIC - 20)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_dynamic_$DEVICE"
part vocab "$T_VOCAB" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" --shape qwen2.5-0.5b-vocab \
    --timeout $(((T_VOCAB - 30) / 2)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_vocab_$DEVICE"
part fused "$T_FUSED" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" --shape qwen2.5-0.5b-vocab \
    --frameworks rlfoundry --rlfoundry-override actor_rollout_ref.model.use_fused_kernels=true \
    --timeout $((T_FUSED - 20)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_fused_$DEVICE"
part wrapped "$T_WRAPPED" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" --frameworks rlfoundry \
    --rlfoundry-override actor_rollout_ref.actor.fsdp_config.single_rank=fsdp \
    --rlfoundry-override actor_rollout_ref.ref.fsdp_config.single_rank=fsdp \
    --timeout $((T_WRAPPED - 20)) --work-dir "$WORK/bench" --results-dir "$OUT" --name "realistic_wrapped_$DEVICE"
# rlfoundry's generation and transformers' compiled static-cache generate on the same rows, in one run (issue 34)
part hfgen "$T_HFGEN" "$PYTHON" -m benchmarks.realistic --device "$DEVICE" "${BENCH_ARGS[@]}" --frameworks rlfoundry \
    --hf-static-generate --timeout $((T_HFGEN - 70)) --work-dir "$WORK/bench" --results-dir "$OUT" \
    --name "realistic_hfgen_$DEVICE"

# ── large: one large model shape on the GPU beside the planner (issue 49 item 5) ─────────────────
# Each run in a child process of its own, under half the part's limit less the peak measurement's share.
if [ "$DRY" = 1 ]; then
    LARGE_ARGS=(--runs tiny:lora tiny:full-offload --prompts 2 --n 2 --response-length 8 --micro 2 --steps 2 --threads 1)
else
    LARGE_ARGS=(--runs qwen2.5-7b:lora qwen2.5-3b:full-offload --steps "${LARGE_STEPS:-4}" --threads 8)
fi
part large "$T_LARGE" "$PYTHON" -m benchmarks.large_shape --device "$DEVICE" "${LARGE_ARGS[@]}" \
    --timeout $(((T_LARGE - 40) / 2)) --work-dir "$WORK/large" --results-dir "$OUT" --name "large_$DEVICE"

# ── summary ──────────────────────────────────────────────────────────────────────────────────────
"$PYTHON" scripts/gpu_check_report.py "$OUT" "$WORK" "$DEVICE" | tee -a "$SUMMARY"
rc=${PIPESTATUS[0]}
# The device tool returns at most 8 files (it dropped summary.txt and tier.log when a run left 10):
# past the 7 named here, the other parts' logs and JSON travel inside extras.tar.gz (summary.json
# already holds their figures).
rm -rf "$WORK/more" && mkdir -p "$WORK/more"
for f in "$OUT"/*; do
    case " summary.txt summary.json env.log tier.log demo.log bench.log realistic_$DEVICE.json " in
        *" $(basename "$f") "*) ;;
        *) [ "$(ls "$OUT" | wc -l)" -gt 7 ] && mv "$f" "$WORK/more/" ;;
    esac
done
(cd "$WORK" && tar czf "$OUT/extras.tar.gz" --ignore-failed-read --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.png' --exclude='*.html' --exclude='checkpoints' pip.log parts.tsv tier.xml demo/metrics.jsonl \
    bench/runs more 2> /dev/null || true)
say "done in $((SECONDS - START))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
