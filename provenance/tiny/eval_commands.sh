#!/usr/bin/env bash
# Per-subset evaluation commands of this run (run from the specquant checkout).
# Each is the captured evaluate command restricted to one prompt set.
set -euo pipefail

# subset chat
python -m pipeline evaluate 'eval.prompt_sets=[{name:"chat",field:"prompt",path:"assets/tiny/eval/chat.jsonl",split:"test"}]'

# subset math
python -m pipeline evaluate 'eval.prompt_sets=[{name:"math",field:"prompt",path:"assets/tiny/eval/math.jsonl",split:"test"}]'

# subset code
python -m pipeline evaluate 'eval.prompt_sets=[{name:"code",field:"prompt",path:"assets/tiny/eval/code.jsonl",split:"test"}]'

# ---- vLLM serving and benchmark commands (eval/vllm_commands.sh) ----
#!/usr/bin/env bash
# Reproduce this evaluation with vLLM on GPUs (greedy, temperature 0):
#   ./vllm_commands.sh serve <variant>     # in one shell: the target with that drafter
#   ./vllm_commands.sh bench <subset>      # in another: one benchmark per subset
# vLLM reports the acceptance length (accepted tokens / drafts + 1) per benchmark.
# Paths are those of this run; use Hub ids instead once the variants are published.
set -euo pipefail

TARGET=assets/tiny/target
PORT=${PORT:-8000}

serve_source() {  # drafter variant source
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "assets/tiny/drafter", "num_speculative_tokens": 7}'
}

serve_bf16() {  # drafter variant bf16
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "runs/tiny/drafter/bf16", "num_speculative_tokens": 7}'
}

serve_nvfp4() {  # drafter variant nvfp4
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "runs/tiny/drafter/nvfp4", "num_speculative_tokens": 7, "quantization": "compressed-tensors"}'
}

serve_nvfp4_nocalib() {  # drafter variant nvfp4-nocalib
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "runs/tiny/drafter/nvfp4-nocalib", "num_speculative_tokens": 7, "quantization": "compressed-tensors"}'
}

serve_nvfp4a16() {  # drafter variant nvfp4a16
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "runs/tiny/drafter/nvfp4a16", "num_speculative_tokens": 7, "quantization": "compressed-tensors"}'
}

serve_w4a16() {  # drafter variant w4a16
  vllm serve "$TARGET" --port "$PORT" --attention-backend FLASH_ATTN \
    --speculative-config '{"method": "dflash", "model": "runs/tiny/drafter/w4a16", "num_speculative_tokens": 7, "quantization": "compressed-tensors"}'
}

bench_chat() {  # subset chat, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path runs/tiny/eval/prompts/chat.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label chat
}

bench_math() {  # subset math, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path runs/tiny/eval/prompts/math.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label math
}

bench_code() {  # subset code, 20 prompts
  vllm bench serve --model "$TARGET" --port "$PORT" --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name custom --dataset-path runs/tiny/eval/prompts/code.jsonl --num-prompts 20 --disable-shuffle \
    --custom-output-len 120 --temperature 0 --max-concurrency 1 --label code
}

case "${1:-}:${2:-}" in
  serve:source) serve_source ;;
  serve:bf16) serve_bf16 ;;
  serve:nvfp4) serve_nvfp4 ;;
  serve:nvfp4-nocalib) serve_nvfp4_nocalib ;;
  serve:nvfp4a16) serve_nvfp4a16 ;;
  serve:w4a16) serve_w4a16 ;;
  bench:chat) bench_chat ;;
  bench:math) bench_math ;;
  bench:code) bench_code ;;
  *) echo "usage: $0 serve <source|bf16|nvfp4|nvfp4-nocalib|nvfp4a16|w4a16> | bench <chat|math|code>" >&2; exit 2 ;;
esac
