#!/usr/bin/env bash
# Kimi-K2 pretraining with Megatron-LM's pretrain_gpt.py and the MoK dispatcher (see pretrain_moe.sh).
#   MEGATRON_LM=/path/to/Megatron-LM NNODES=.. NODE_RANK=.. MASTER_ADDR=.. bash examples/pretrain_kimi_k2.sh
#   SCALE=small bash examples/pretrain_kimi_k2.sh        # 4 layers, 16 experts: fits one H200 (EP=1)
MODEL=kimi-k2 exec bash "$(dirname "$0")/pretrain_moe.sh" "$@"
