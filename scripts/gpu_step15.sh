#!/usr/bin/env bash
# Part 15 on one GPU (the device tool's H200) in one run of at most 9 minutes:
#   0. the carried wheels (.whl/, made by scripts/gpu_wheels.sh) into a --target folder: the GPU
#      image lacks fastapi, pydantic, msgspec, pyzmq, gguf, xgrammar and what they need;
#   1. tests/test_gpu.py's default-path tests (i): compiled, bf16, FULL decode graphs past 32
#      sequences, graphs' tokens against enforce_eager (fp32 exactly, bf16 up to near-ties) and
#      against the same compiled engine without graphs;
#   2. the sync audit: host-device syncs per decode step at temperature 0 and at temperature 1.0
#      with top_p 0.9 (the profiler's count per step, and the lines that sync under
#      torch.cuda.set_sync_debug_mode("warn")), batch 64 on SmolLM2-135M's shapes, default path;
#   3. throughput, part 04 against part 15 eager and part 15 at its defaults (compiled + graphs),
#      2 rounds, bf16, random weights: 256 requests on SmolLM2-135M's shapes, 128 on Llama-3.2-1B's,
#      prompts 32-256 and outputs 16-128 tokens;
#   4. if time remains: the decode step at batch 1, 64, 256 against the roofline, graphs on, then off.
#
# Time: each step runs under `timeout` with a cap, and the script keeps a global deadline: a step
# gets min(its cap, what is left of BUDGET) and is skipped when less than its minimum is left.
# Caps (every timeout in the script): setup 40 + tests 120 + sync audit 90 + throughput 120 + 115
# + roofline 35 + 15 + summary 5 = 540 s (9 min), within a 10-minute device command. Guesses for
# an H200 (nothing here has run on one yet): a part 15 engine at its defaults compiles its model
# (tens of seconds cold, less from Inductor's cache) and the throughput runs load each engine once
# per round.
#
# Results under $OUT (at most 8 files come back from the device): log.txt (everything printed),
# gpu_tests.jsonl, sync_audit.json, throughput_135m.json, throughput_1b.json, roofline_graphs.json,
# roofline_eager.json.
#
#   on the device: command `bash scripts/gpu_step15.sh`, carry [".whl"], timeout_s 600 (OUT is set there)
#   DRY=1 OUT=/tmp/gpu bash scripts/gpu_step15.sh    # on a CPU: the same commands, tiny models, fp32
#   WHEELS=DIR: another wheel folder (a dry run on another Python: see scripts/gpu_wheels.sh);
#   WHEELS=none: install nothing (the packages are there already).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_step15}
MODELS=${MODELS:-/tmp/gpu_step15_models}  # config.json only: outside $OUT, whose files come back
DRY=${DRY:-0}
PY=${PY:-python3}  # the GPU image's python3 holds torch
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" "$MODELS"
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1

# Seconds, all steps together. A dry run on a 2-core CPU is slower (compiles its C kernels, no GPU):
# its caps and budget are 3 times the GPU's.
SCALE=1
[ "$DRY" = 1 ] && SCALE=3
BUDGET=${BUDGET:-$((540 * SCALE))}
T0=$SECONDS
CAPS=(40 120 90 120 115 35 15 5)  # the caps of the step calls below, in order: keep the two together
echo "gpu_step15: DRY=$DRY, budget ${BUDGET}s, caps ${CAPS[*]} = $(( $(IFS=+; echo "${CAPS[*]}") ))s, $(date -u)"

# step NAME CAP MIN CMD...: CMD under timeout min(CAP, time left); skipped if less than MIN is left.
# `timeout` signals CMD's whole process group (engine workers too), and -k kills what ignores
# SIGTERM a few seconds later: that grace comes out of the step's share (never `timeout 0`, which
# would mean no limit).
step() {
  local name=$1 cap=$(($2 * SCALE)) min=$3 left t grace start rc
  shift 3
  left=$((BUDGET - (SECONDS - T0)))
  t=$((cap < left ? cap : left))
  if [ "$t" -lt "$min" ]; then
    echo "=== $name: skipped, ${left}s left of ${BUDGET}s (needs ${min}s)"
    return 0
  fi
  echo "=== $name: timeout ${t}s (${left}s left)"
  grace=$((t >= 20 ? 5 : 1))
  start=$SECONDS
  timeout -k $grace $((t - grace)) "$@"
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start))s$([ $rc = 124 ] && echo ' (timed out)')"
  return $rc
}

# 0. Setup: the wheels into a folder of their own, put first on the path (PYTHONPATH reaches the
# tests' and benchmarks' subprocesses too; the image's typing-extensions is kept unless pydantic
# needs a newer one), then what the run stands on: the GPU, the image's versions, and whether part
# 15 imports with the wheels (printed; the steps run either way).
SITE=$(mktemp -d /tmp/gpu_step15_site.XXXX)
[ "$WHEELS" != none ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
setup() {
  if [ "$WHEELS" != none ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
      || return 1
    if ! "$PY" -c 'import importlib.metadata as m, sys
v = tuple(int(x) for x in m.version("typing_extensions").split(".")[:3])
sys.exit(v < (4, 14, 1))'; then
      echo "typing-extensions older than pydantic needs: installing the carried one"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/fallback/*.whl || return 1
    fi
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  "$PY" - <<'PYEOF'
import importlib.metadata as m, sys
def version(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return None
print("python", sys.version.split()[0], {p: version(p) for p in ("torch", "triton", "transformers", "numpy",
      "typing_extensions", "anyio", "pydantic", "fastapi", "xgrammar")})
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
import part15_full.server, part15_full.llm, shared.bench.__main__, xgrammar  # noqa: F401,E401
print("imports: part15_full.server, part15_full.llm, shared.bench, xgrammar: ok")
PYEOF
  true
}
export -f setup
export PY WHEELS SITE
step setup 40 10 bash -c setup
if [ "$WHEELS" != none ] && [ -z "$(ls -A "$SITE")" ]; then echo "setup failed: no wheel installed"; exit 1; fi

# Model configs (random weights: --load-format dummy). On DRY both shapes shrink to a tiny model.
"$PY" - "$MODELS" "$DRY" <<'EOF'
import json, sys
from pathlib import Path
root, dry = Path(sys.argv[1]), sys.argv[2] == "1"
llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, "hidden_act": "silu",
         "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
shapes = {  # SmolLM2-135M-Instruct's and Llama-3.2-1B's shapes
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=True),
}
if dry:  # the same script on a CPU: both "models" tiny
    for s in shapes.values():
        s.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, head_dim=16)
for name, s in shapes.items():
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "config.json").write_text(json.dumps({**llama, **s}, indent=1))
EOF

# DRY runs fp32: the benchmarks time an n=2048 GEMM for the machine's peak, which takes minutes in
# bf16 on a CPU without native bf16 (AVX2 only: 12 s a call here).
if [ "$DRY" = 1 ]; then
  N135=8; N1B=4; BATCH=4; BATCHES=1,4; STEPS=4; DEV="--device cpu"; DT=float32
else
  N135=256; N1B=128; BATCH=64; BATCHES=1,64,256; STEPS=16; DEV=""; DT=bfloat16
fi
M135="$MODELS/smollm2-135m"; M1B="$MODELS/llama-1b"
COMMON="--load-format dummy --dtype $DT --input-len 32:256 --output-len 16:128 --seed 11 --rounds 2
        --baselines none --no-progress $DEV"

# 1. The default-path CUDA-graph tests. (h) and the rest of the tier need the embedded SmolLM2, a
# 98 MB GGUF the device tool cannot carry (64 MiB a call): they are left out here. On a CPU every
# test skips (needs CUDA), which still checks that the file collects with these packages.
GPU_TEST_SUMMARY="$OUT/gpu_tests.jsonl" step "tests (default path)" 120 60 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py -k default_path -o addopts="" -rfEs --durations=8

# 2. The sync audit, one engine at its defaults (compiled + FULL decode graphs), two sampling settings.
step "sync audit" 90 40 "$PY" -m shared.bench.step_profile --part part15_full --model "$M135" --load-format dummy \
  --dtype $DT --batch $BATCH --steps $STEPS --temperature 0,1.0 --top-p 1.0,0.9 --sync-sources $DEV \
  --json "$OUT/sync_audit.json"

# 3. Throughput, one run per shape: the engines interleaved over 2 rounds, the faster round counts.
step "throughput 135m" 120 60 "$PY" -m shared.bench throughput --part part15_full --model "$M135" $COMMON \
  --num-requests $N135 --compare part04_continuous_batching --compare part15_full:enforce_eager=True \
  --json "$OUT/throughput_135m.json"
step "throughput 1b" 115 60 "$PY" -m shared.bench throughput --part part15_full --model "$M1B" $COMMON \
  --num-requests $N1B --compare part04_continuous_batching --compare part15_full:enforce_eager=True \
  --json "$OUT/throughput_1b.json"

# 4. The roofline, with what is left (graphs first: the default path).
step "roofline (graphs)" 35 25 "$PY" -m shared.bench roofline --part part15_full --model "$M135" --load-format dummy \
  --dtype $DT --batch-sizes $BATCHES --max-num-seqs 256 $DEV --json "$OUT/roofline_graphs.json"
step "roofline (eager)" 15 10 "$PY" -m shared.bench roofline --part part15_full --model "$M135" --load-format dummy \
  --dtype $DT --batch-sizes $BATCHES --max-num-seqs 256 --engine-arg enforce_eager=True $DEV \
  --json "$OUT/roofline_eager.json"

# The headline numbers, for the end of the log (what the device tool's reply shows).
step summary 5 3 "$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for line in (out / "gpu_tests.jsonl").read_text().splitlines() if (out / "gpu_tests.jsonl").exists() else []:
    d = json.loads(line)
    print("test:", {k: v for k, v in d.items() if not k.startswith("parted")})
if (out / "sync_audit.json").exists():
    for r in json.loads((out / "sync_audit.json").read_text()):
        print(f"sync audit T={r['temperature']} top_p={r['top_p']}: {r['syncs_per_decode_step']} syncs/decode step "
              f"{r['sync_kinds_per_decode_step']}, {r['wall_ms_per_step']:.2f} ms/step wall, "
              f"{r['kernel_ms_per_step']:.2f} ms kernels, {r['graph_launches_per_decode_step']} graph launches; "
              f"sources per step: {(r['sync_sources'] or {}).get('per_step')}")
EOF
echo "gpu_step15: done in $((SECONDS - T0))s of ${BUDGET}s"
ls -la "$OUT"
rm -rf "$SITE"
exec >&- 2>&-
wait "$TEE"  # the log complete before the device tool collects $OUT
