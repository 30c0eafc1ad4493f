#!/usr/bin/env bash
# DeepSeek-V3 pretraining with Megatron-LM's pretrain_gpt.py and the MoK dispatcher (see pretrain_moe.sh).
#   MEGATRON_LM=/path/to/Megatron-LM NNODES=.. NODE_RANK=.. MASTER_ADDR=.. bash examples/pretrain_deepseek_v3.sh
#   SCALE=small bash examples/pretrain_deepseek_v3.sh        # 4 layers, 16 experts: fits one H200 (EP=1)
MODEL=deepseek-v3 exec bash "$(dirname "$0")/pretrain_moe.sh" "$@"
