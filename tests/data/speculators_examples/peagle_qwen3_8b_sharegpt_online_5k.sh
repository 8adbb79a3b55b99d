# ============ Configuration ============
MODEL="Qwen/Qwen3-8B"
DATASET="sharegpt"                # sharegpt, ultrachat, or path to custom data
OUTPUT_DIR="./output/peagle_qwen3_8b_sharegpt"
VLLM_PORT=8108
MAX_SAMPLES=5000
SEQ_LENGTH=4096
EPOCHS=5
LR=6e-4

# P-EAGLE-specific parameters
SPECULATOR_TYPE="peagle"
NUM_LAYERS=4
NUM_DEPTHS=4
DOWN_SAMPLE_RATIO=0.7
DOWN_SAMPLE_RATIO_MIN=0.2
# GPU assignments (online training needs separate GPUs for vLLM and training)
VLLM_GPUS="2,3"
TRAIN_GPUS="4,5"
NUM_TRAIN_GPUS=2
# =======================================

# --- the example's command lines, verbatim ---
python scripts/prepare_data.py \
    --model "$MODEL" \
    --data "$DATASET" \
    --output "$OUTPUT_DIR" \
    --max-samples "$MAX_SAMPLES" \
    --seq-length "$SEQ_LENGTH"

CUDA_VISIBLE_DEVICES="$VLLM_GPUS" python scripts/launch_vllm.py "$MODEL" \
    --hidden-states-path "$OUTPUT_DIR/hidden_states" \
    -- --data-parallel-size 2 --port "$VLLM_PORT" --gpu-memory-utilization 0.85 &

CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" torchrun \
    --standalone --nproc_per_node "$NUM_TRAIN_GPUS" \
    scripts/train.py \
    --verifier-name-or-path "$MODEL" \
    --data-path "$OUTPUT_DIR" \
    --vllm-endpoint "http://localhost:${VLLM_PORT}/v1" \
    --hidden-states-path "$OUTPUT_DIR/hidden_states" \
    --save-path "$OUTPUT_DIR/checkpoints" \
    --epochs "$EPOCHS" \
    --lr "$LR" \
    --total-seq-len "$SEQ_LENGTH" \
    --speculator-type "$SPECULATOR_TYPE" \
    --num-layers "$NUM_LAYERS" \
    --num-depths "$NUM_DEPTHS" \
    --down-sample-ratio "$DOWN_SAMPLE_RATIO" \
    --down-sample-ratio-min "$DOWN_SAMPLE_RATIO_MIN" \
    --no-norm-before-residual \
    --scheduler-type cosine \
    --on-missing generate \
    --on-generate delete
