#!/usr/bin/env bash
# Part 15 on one GPU, in one run of under 10 minutes: the GPU tier of part 15's CUDA graphs, a
# torch-profiler look at one decode step (wall against kernel time, launches, syncs), throughput on
# SmolLM2-135M shapes (256 requests) and Llama-1B shapes (128 requests), prompts 32-256 and outputs
# 16-128, bf16, random weights (--load-format dummy): part 04, part 15 eager, part 15 with CUDA
# graphs (FULL_DECODE_ONLY over the compiled forward, and FULL_AND_PIECEWISE uncompiled), HF's
# generate_batch; and the decode step at batch 1, 64 and 256 against the roofline floor.
# Every result is a JSON file under $OUT (the machine named in each).
#
#   OUT=/tmp/gpu bash scripts/gpu_step15.sh          # on the GPU
#   DRY=1 OUT=/tmp/gpu bash scripts/gpu_step15.sh    # on a CPU: the same commands on a tiny model
set -uo pipefail
OUT=${OUT:-/tmp/gpu_step15}
MODELS=${MODELS:-/tmp/gpu_step15_models}  # config.json only: outside $OUT, whose files come back
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1
DRY=${DRY:-0}

python - "$MODELS" "$DRY" <<'EOF'
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

if [ "$DRY" = 1 ]; then
  N135=8; N1B=4; BATCHES=1,4; STEPS=4; T=300; DEV="--device cpu"
else
  N135=256; N1B=128; BATCHES=1,64,256; STEPS=20; T=150; DEV=""
fi
M135="$MODELS/smollm2-135m"; M1B="$MODELS/llama-1b"
COMMON="--load-format dummy --dtype bfloat16 --input-len 32:256 --output-len 16:128 --seed 11 --no-progress $DEV"
GRAPHS_PIECEWISE='part15_full:compilation_mode=none,compilation_config={"cudagraph_mode":"FULL_AND_PIECEWISE"}'

(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; python -c "import torch; print(torch.__version__, torch.version.cuda)") | tee "$OUT/machine.txt"

# 1. The GPU tier's CUDA-graph and KV-sizing tests (HF's greedy in fp32 is the oracle).
if [ "$DRY" != 1 ]; then
  timeout 240 python -m pytest -q -x tests/test_gpu.py -k "cuda_graphs or kv_cache_is_sized" -p no:cacheprovider \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi

# 2. One decode step under the profiler: batch 64, eager, compiled + FULL decode graphs, uncompiled + graphs.
for variant in "eager:--engine-arg enforce_eager=True" "graphs:" \
               'piecewise:--engine-arg compilation_mode=none --engine-arg compilation_config={"cudagraph_mode":"FULL_AND_PIECEWISE"}'; do
  name=${variant%%:*}; args=${variant#*:}
  timeout $T python -m shared.bench.step_profile --part part15_full --model "$M135" --load-format dummy \
    --dtype bfloat16 --batch $([ "$DRY" = 1 ] && echo 4 || echo 64) --steps $STEPS $DEV $args \
    2>&1 | tail -1 | tee -a "$OUT/step_profiles.jsonl"
done
timeout $T python -m shared.bench.step_profile --part part04_continuous_batching --model "$M135" --load-format dummy \
  --dtype bfloat16 --batch $([ "$DRY" = 1 ] && echo 4 || echo 64) --steps $STEPS $DEV \
  2>&1 | tail -1 | tee -a "$OUT/step_profiles.jsonl"

# 3. Throughput, one run per shape: every engine on the same workload.
timeout $((2 * T)) python -m shared.bench throughput --part part15_full --model "$M135" $COMMON --num-requests $N135 \
  --compare part04_continuous_batching --compare part15_full:enforce_eager=True --compare "$GRAPHS_PIECEWISE" \
  --baselines hf-generate-batch --json "$OUT/throughput_135m.json" 2>&1 | tail -12
timeout $((2 * T)) python -m shared.bench throughput --part part15_full --model "$M1B" $COMMON --num-requests $N1B \
  --compare part04_continuous_batching --compare part15_full:enforce_eager=True \
  --baselines hf-generate-batch --json "$OUT/throughput_1b.json" 2>&1 | tail -10

# 4. The decode step at batch 1, 64, 256 against the roofline floor, graphs on and off.
timeout $T python -m shared.bench roofline --part part15_full --model "$M135" --load-format dummy --dtype bfloat16 \
  --batch-sizes $BATCHES --max-num-seqs 256 $DEV --json "$OUT/roofline_graphs.json" 2>&1 | tail -6
timeout $T python -m shared.bench roofline --part part15_full --model "$M135" --load-format dummy --dtype bfloat16 \
  --batch-sizes $BATCHES --max-num-seqs 256 --engine-arg enforce_eager=True $DEV \
  --json "$OUT/roofline_eager.json" 2>&1 | tail -6
ls -la "$OUT"
