#!/usr/bin/env bash
# Per-subset evaluation commands of this run (run from the specquant checkout).
# Each is the captured evaluate command restricted to one prompt set.
set -euo pipefail

# subset chat
python -m pipeline evaluate runs_root=/tmp/refrun/a 'eval.prompt_sets=[{name:"chat",field:"prompt",path:"assets/tiny/eval/chat.jsonl",split:"test"}]'

# subset math
python -m pipeline evaluate runs_root=/tmp/refrun/a 'eval.prompt_sets=[{name:"math",field:"prompt",path:"assets/tiny/eval/math.jsonl",split:"test"}]'

# subset code
python -m pipeline evaluate runs_root=/tmp/refrun/a 'eval.prompt_sets=[{name:"code",field:"prompt",path:"assets/tiny/eval/code.jsonl",split:"test"}]'

# ---- vLLM serving and benchmark commands (eval/vllm_commands.sh) ----
#!/usr/bin/env bash
# Reproduce this evaluation with vLLM on GPUs (greedy, temperature 0):
#   ./vllm_commands.sh serve <variant>     # in one shell: the target with that drafter
#   ./vllm_commands.sh bench <subset>      # in another: one benchmark per subset
# vLLM reports the acceptance length (accepted tokens / drafts + 1) per benchmark.
# Paths are those of this run; use Hub ids instead once the variants are published.
# The vLLM range each drafter was written and checked for (quant.vllm, pipeline/serving/contract.py):
#   source: not recorded (no quantize-drafter record names one)
#   bf16: not recorded (no quantize-drafter record names one)
#   nvfp4: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   nvfp4-nocalib: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   nvfp4a16: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   nvfp4a16-gptq: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   w4a16: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   w4a16-gptq: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   w4a16-gptq-on-w4a16: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   w4a16-imatrix: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
#   w4a16-imatrix-on-w4a16: vLLM 0.32.0 and newer (read in 0.32.0-0.34.0) (profile 0.32+)
set -euo pipefail

TARGET=assets/tiny/target
PORT=${PORT:-8000}

serve_source() {  # drafter variant source
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"assets/tiny/drafter","num_speculative_tokens":7}' \
    --port "$PORT"
}

serve_bf16() {  # drafter variant bf16
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/bf16","num_speculative_tokens":7}' \
    --port "$PORT"
}

serve_nvfp4() {  # drafter variant nvfp4
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/nvfp4","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_nvfp4_nocalib() {  # drafter variant nvfp4-nocalib
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/nvfp4-nocalib","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_nvfp4a16() {  # drafter variant nvfp4a16
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/nvfp4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_nvfp4a16_gptq() {  # drafter variant nvfp4a16-gptq
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/nvfp4a16-gptq","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_w4a16() {  # drafter variant w4a16
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_w4a16_gptq() {  # drafter variant w4a16-gptq
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/w4a16-gptq","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_w4a16_gptq_on_w4a16() {  # drafter variant w4a16-gptq-on-w4a16
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/w4a16-gptq-on-w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_w4a16_imatrix() {  # drafter variant w4a16-imatrix
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/w4a16-imatrix","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

serve_w4a16_imatrix_on_w4a16() {  # drafter variant w4a16-imatrix-on-w4a16
  vllm serve "$TARGET" --attention-backend FLASH_ATTN --speculative-config '{"method":"dflash","model":"/tmp/refrun/a/tiny/drafter/w4a16-imatrix-on-w4a16","num_speculative_tokens":7,"quantization":"compressed-tensors"}' \
    --port "$PORT"
}

bench_chat() {  # subset chat, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path /tmp/refrun/a/tiny/eval/prompts/chat.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label chat
}

bench_math() {  # subset math, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path /tmp/refrun/a/tiny/eval/prompts/math.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label math
}

bench_code() {  # subset code, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path /tmp/refrun/a/tiny/eval/prompts/code.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label code
}

case "${1:-}:${2:-}" in
  serve:source) serve_source ;;
  serve:bf16) serve_bf16 ;;
  serve:nvfp4) serve_nvfp4 ;;
  serve:nvfp4-nocalib) serve_nvfp4_nocalib ;;
  serve:nvfp4a16) serve_nvfp4a16 ;;
  serve:nvfp4a16-gptq) serve_nvfp4a16_gptq ;;
  serve:w4a16) serve_w4a16 ;;
  serve:w4a16-gptq) serve_w4a16_gptq ;;
  serve:w4a16-gptq-on-w4a16) serve_w4a16_gptq_on_w4a16 ;;
  serve:w4a16-imatrix) serve_w4a16_imatrix ;;
  serve:w4a16-imatrix-on-w4a16) serve_w4a16_imatrix_on_w4a16 ;;
  bench:chat) bench_chat ;;
  bench:math) bench_math ;;
  bench:code) bench_code ;;
  *) echo "usage: $0 serve <source|bf16|nvfp4|nvfp4-nocalib|nvfp4a16|nvfp4a16-gptq|w4a16|w4a16-gptq|w4a16-gptq-on-w4a16|w4a16-imatrix|w4a16-imatrix-on-w4a16> | bench <chat|math|code>" >&2; exit 2 ;;
esac
