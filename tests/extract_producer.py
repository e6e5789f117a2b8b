"""Stand-in for vLLM's extraction worker where there is no GPU (tests only; not a test module).

Speaks the protocol of `pipeline.serving.extract` (the job file; each sample's file at
`extract.sample_path`; `result.json` at the end; waits while more than `backlog` chunks are unread)
and writes each sample
the way vLLM 0.26's ExampleHiddenStatesConnector does (`_write_tensors`: safetensors with
`hidden_states` [T, n_aux, H] and `token_ids` [T], written while an exclusive flock is held on
`<file>.lock`). The states are the HF engine's own (`pipeline.stages.cache.LayerCapture`, one sample per
forward), so a cache streamed from these files must equal the HF engine's cache byte for byte.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path


def main(job_file: str) -> int:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel

    from pipeline.serving.extract import _pending, _read_samples, _write, sample_path
    from pipeline.stages.cache import LayerCapture

    job = json.loads(Path(job_file).read_text(encoding="utf-8"))
    out = Path(job["out_dir"])
    torch.set_num_threads(1)
    ids = _read_samples(job["samples"], {g for c in job["chunks"] for g in c})
    model = AutoModel.from_pretrained(job["target"], dtype=torch.float32).eval()
    capture = LayerCapture(model, list(job["aux_layer_ids"]))
    per = max(len(c) for c in job["chunks"])
    fail_after = int(os.environ.get("EXTRACT_PRODUCER_FAIL_AFTER", "-1"))  # a crash after that many samples
    done = 0
    for chunk in job["chunks"]:
        while _pending(out) > int(job["backlog"]) * per:
            time.sleep(0.01)
        for g in chunk:
            if done == fail_after:
                _write(out / "result.json", {"ok": False, "error": "RuntimeError: CUDA error: an illegal memory access"})
                return 1
            done += 1
            path = sample_path(out, g)
            fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            with torch.inference_mode():
                hs = torch.stack(capture(torch.tensor([ids[g]]), None), dim=2)[0]  # [T, n_aux, H]
            save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids[g])}, path)
            os.close(fd)
    _write(out / "result.json", {"ok": True, "load_s": 0.0, "extract_s": 0.0, "versions": {"vllm": "stand-in"}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
