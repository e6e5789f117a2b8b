#!/usr/bin/env bash
# Serve the target with each drafter variant of this run as its DFlash drafter.
# Pick one variant: bash vllm_serve.sh <variant>. Needs an attention backend that supports
# non-causal attention (e.g. flash_attn). A relative target path is relative to the specquant
# checkout; drafter paths are inside this run directory.
set -euo pipefail
RUN_DIR="${RUN_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
VARIANT="${1:?usage: vllm_serve.sh <variant>}"
case "$VARIANT" in
  bf16) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/bf16","num_speculative_tokens":7}' ;;
  nvfp4) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/nvfp4","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  nvfp4-nocalib) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/nvfp4-nocalib","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  nvfp4a16) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/nvfp4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  nvfp4a16-gptq) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/nvfp4a16-gptq","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  w4a16) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  w4a16-gptq) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/w4a16-gptq","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  w4a16-gptq-on-w4a16) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/w4a16-gptq-on-w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  w4a16-imatrix) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/w4a16-imatrix","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  w4a16-imatrix-on-w4a16) exec vllm serve assets/tiny/target --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"'"$RUN_DIR"'/drafter/w4a16-imatrix-on-w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' ;;
  *) echo "unknown variant $VARIANT; choose one of: bf16 nvfp4 nvfp4-nocalib nvfp4a16 nvfp4a16-gptq w4a16 w4a16-gptq w4a16-gptq-on-w4a16 w4a16-imatrix w4a16-imatrix-on-w4a16" >&2; exit 2 ;;
esac
