#!/usr/bin/env bash
# MoE pretraining with Megatron-LM's pretrain_gpt.py and the MoK dispatcher, for MODEL=kimi-k2 or
# MODEL=deepseek-v3 (examples/pretrain_kimi_k2.sh and pretrain_deepseek_v3.sh set it).
#   MODEL=kimi-k2 MEGATRON_LM=/path/to/Megatron-LM NNODES=.. NODE_RANK=.. MASTER_ADDR=.. bash examples/pretrain_moe.sh
#   MODEL=kimi-k2 SCALE=small bash examples/pretrain_moe.sh     # 4 layers, 16 experts: fits one H200 (EP=1)
#   MODEL=kimi-k2 SCALE=small TE=0 GPUS_PER_NODE=1 TRAIN_ITERS=20 bash examples/pretrain_moe.sh
#       # without Transformer Engine (Megatron's local layers): MLA needs TE's attention in megatron-core
#       # 0.19, so attention becomes GQA-8 (kv 128) and TE/apex-only fusions are switched off; vocab 32768
#       # keeps the 4-layer model at ~61 GiB of weights + Adam states. The MoE part (and MoK) is unchanged.
# Architecture flags follow the public recipes:
#   Kimi-K2: 61 layers (1 dense + 60 MoE), MLA, 384 experts of ffn 2048, top-8, one shared expert, sigmoid
#            router with expert bias.
#   DeepSeek-V3: 61 layers (3 dense + 58 MoE), MLA, 256 experts of ffn 2048, top-8, one shared expert,
#            sigmoid router with expert bias, 8 groups / top-4 groups.
# MoK replaces the dispatcher: --moe-token-dispatcher-type mok --mok-config $MODEL
# (configs/$MODEL.yaml: SM split, ring, minibatch).
set -euo pipefail
MODEL=${MODEL:?set MODEL=kimi-k2 or MODEL=deepseek-v3}
case "$MODEL" in
  kimi-k2)
    DENSE=1; EXPERTS=384; HEADS=64; ROTARY_BASE=50000; VOCAB=163840
    ROUTER=(--moe-router-topk-scaling-factor 2.827) ;;
  deepseek-v3)
    DENSE=3; EXPERTS=256; HEADS=128; ROTARY_BASE=10000; VOCAB=129280
    ROUTER=(--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 8 --moe-router-group-topk 4) ;;
  *) echo "pretrain_moe.sh: unknown MODEL=$MODEL (kimi-k2, deepseek-v3)" >&2; exit 2 ;;
esac
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"
SCALE=${SCALE:-full}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [ "$SCALE" = small ]; then
  ARCH=(--num-layers 4 --moe-layer-freq "([0]*1+[1]*3)" --num-experts 16 --hidden-size 7168
         --ffn-hidden-size 18432 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048)
  PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 1)
  BATCH=(--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --max-position-embeddings 4096)
  MOK_CFG=${MOK_CONFIG_PATH:-$MODEL-small.yaml}
  # the small variant keeps Kimi's per-expert shapes but has 16 experts: write a matching MoK config
  python - "$MOK_CFG" "$MODEL" <<'PY'
import sys, yaml
from megatron_mok.config import load_config
import dataclasses
cfg = load_config(sys.argv[2])
raw = {"model": {**dataclasses.asdict(cfg.model), "name": f"{sys.argv[2]}-small", "num_moe_experts": 16},
       "kernel": {k: v for k, v in dataclasses.asdict(cfg.kernel).items()}}
open(sys.argv[1], "w").write(yaml.safe_dump(raw))
PY
else
  ARCH=(--num-layers 61 --moe-layer-freq "([0]*$DENSE+[1]*$((61 - DENSE)))" --num-experts $EXPERTS --hidden-size 7168
         --ffn-hidden-size 18432 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048)
  PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64
       --expert-tensor-parallel-size 1 --sequence-parallel)
  BATCH=(--micro-batch-size 1 --global-batch-size 2048 --seq-length 4096 --max-position-embeddings 4096)
  MOK_CFG=$MODEL
fi
if [ "${TE:-1}" = 0 ]; then
  ATTN=(--num-attention-heads $HEADS --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm)
  NO_TE=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion
         --no-masked-softmax-fusion --attention-dropout 0 --hidden-dropout 0 --eval-iters 0)
  VOCAB=${VOCAB_SIZE:-32768}
else
  ATTN=(--num-attention-heads $HEADS --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512
        --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm)
  NO_TE=(--transformer-impl "${TRANSFORMER_IMPL:-transformer_engine}")
  VOCAB=${VOCAB_SIZE:-$VOCAB}
fi
torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-6000}" \
  -m megatron_mok.launch "$MEGATRON_LM/pretrain_gpt.py" \
  "${ARCH[@]}" "${PAR[@]}" "${BATCH[@]}" \
  "${ATTN[@]}" \
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
  --position-embedding-type rope --rotary-base $ROTARY_BASE \
  --moe-router-topk 8 --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --moe-router-bias-update-rate 1e-3 "${ROUTER[@]}" --moe-router-dtype fp32 \
  --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss \
  --moe-token-dispatcher-type mok --mok-config "$MOK_CFG" \
  --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
  --train-iters "${TRAIN_ITERS:-500}" --log-interval 1 --eval-interval "${EVAL_INTERVAL:-1000}" \
  --mock-data --tokenizer-type NullTokenizer --vocab-size $VOCAB \
  "${NO_TE[@]}" "$@"
