# ============ Configuration ============
MODEL="meta-llama/Llama-3.1-8B-Instruct"
DATASET="ultrachat"                # sharegpt, ultrachat, or path to custom data
OUTPUT_DIR="./output"
HIDDEN_STATES_DIR="$OUTPUT_DIR/hidden_states"
VLLM_PORT=8000
MAX_SAMPLES=5000
DRAFT_VOCAB_SIZE=32000
SEQ_LENGTH=8192
EPOCHS=5
LR=1e-4
CONCURRENCY=32                    # Parallel requests to vLLM during data generation

# GPU assignments (offline reuses the same GPUs sequentially)
GPUS="0,1"
NUM_GPUS=2
# =======================================

# --- the example's command lines, verbatim ---
python scripts/prepare_data.py \
    --model "$MODEL" \
    --data "$DATASET" \
    --max-samples "$MAX_SAMPLES" \
    --output "$OUTPUT_DIR" \
    --seq-length "$SEQ_LENGTH"

CUDA_VISIBLE_DEVICES="$GPUS" python scripts/launch_vllm.py "$MODEL" \
    -- --data-parallel-size 2 --port "$VLLM_PORT" --gpu-memory-utilization 0.85 &

python scripts/data_generation_offline.py \
    --preprocessed-data "$OUTPUT_DIR" \
    --endpoint "http://localhost:${VLLM_PORT}/v1" \
    --output "$HIDDEN_STATES_DIR" \
    --max-samples "$MAX_SAMPLES" \
    --concurrency "$CONCURRENCY" \
    --validate-outputs

CUDA_VISIBLE_DEVICES="$GPUS" torchrun \
    --standalone --nproc_per_node "$NUM_GPUS" \
    scripts/train.py \
    --verifier-name-or-path "$MODEL" \
    --data-path "$OUTPUT_DIR" \
    --hidden-states-path "$HIDDEN_STATES_DIR" \
    --save-path "$OUTPUT_DIR/checkpoints" \
    --draft-vocab-size "$DRAFT_VOCAB_SIZE" \
    --epochs "$EPOCHS" \
    --lr "$LR" \
    --total-seq-len "$SEQ_LENGTH" \
    --on-missing raise
