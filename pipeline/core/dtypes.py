"""The one table of dtype names: what a config names (target.dtype, cache.storage_dtype) and what a
safetensors header calls each torch dtype (the cache's shards are written without the safetensors library)."""

from __future__ import annotations

import torch

# target.dtype: the dtypes a model is loaded and run in
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch dtype -> safetensors header "dtype"
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}
