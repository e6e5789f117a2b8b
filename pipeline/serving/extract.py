"""cache.engine=vllm worker: vLLM's `extract_hidden_states` writes the target's aux-layer states.

    <vLLM interpreter> -m pipeline.serving.extract JOB.json

Runs inside vLLM's own interpreter (like `pipeline.serving.worker`, it imports only the standard
library and vLLM), with the engine core in its own process (vLLM's default): an in-process engine
only steps when asked, so the last requests' writes would never start after `generate()` returns.

The job names the target, the aux layer ids (HF `output_hidden_states` numbering, which is what
vLLM's `eagle_aux_hidden_state_layer_ids` means: id i = the input of decoder layer i), the data
stage's samples.jsonl and the chunks to extract (lists of sample indices; one chunk = one shard of
the cache). The samples go to vLLM as one stream of `max_tokens=1` requests in chunk order (added
through `LLM.enqueue`, the engine stepped here): vLLM's ExampleHiddenStatesConnector
writes one safetensors file per request (`hidden_states` [T, n_aux, H], `token_ids` [T]) at
`sample_path(out_dir, g)` (the request names it, `allow_custom_save_path`), behind an exclusive flock
on `<file>.lock` until written, so the reader takes each sample as soon as vLLM has it, while the
rest of its chunk is still being computed. At most a chunk's worth of requests is queued in vLLM,
and none is added while more than `backlog` chunks' files wait for the reader (it deletes each one it
has read), so the scratch space holds a bounded number of samples whatever the dataset size. The worker exits once every file is
complete; `result.json` closes the run (or says why it failed).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(obj, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _read_samples(path: str, wanted: set[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    with open(path, encoding="utf-8-sig") as fh:
        for i, line in enumerate(fh):
            if i in wanted:
                out[i] = list(json.loads(line)["input_ids"])
    return out


def sample_path(out_dir: str | os.PathLike, g: int) -> str:
    """Where sample `g`'s file is written (the reader and the stand-in producer of the tests use it too)."""
    return os.path.join(str(out_dir), f"sample-{g:08d}.safetensors")


def _pending(out_dir: Path) -> int:
    return sum(1 for e in os.scandir(out_dir) if e.name.endswith(".safetensors"))


def _engine_kwargs(job: dict, out_dir: Path) -> dict:
    """The `vllm.LLM` arguments: the target with vLLM's hidden-states extractor and its file connector."""
    kwargs = dict(
        model=job["target"], skip_tokenizer_init=True, dtype=job.get("dtype", "bfloat16"),
        enforce_eager=bool(job.get("enforce_eager", True)), max_model_len=int(job["max_model_len"]),
        max_num_batched_tokens=int(job["max_num_batched_tokens"]), enable_prefix_caching=False,
        tensor_parallel_size=int(job.get("tensor_parallel_size", 1)), seed=int(job.get("seed", 0)),
        gpu_memory_utilization=float(job.get("gpu_memory_utilization", 0.85)),
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {
                                "eagle_aux_hidden_state_layer_ids": list(job["aux_layer_ids"])}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(out_dir),
                                                          "allow_custom_save_path": True}})
    if job.get("attention_backend"):
        kwargs["attention_backend"] = job["attention_backend"]
    return kwargs


def _extract(llm, job: dict, ids: dict, order: list[int], per_sample: int, out_dir: Path) -> list[str]:
    """One continuous request stream in shard order (no drain at a shard's end): requests are added while fewer
    than a shard's worth are queued in vLLM and the reader has consumed all but `backlog` shards' files, so the
    scratch space stays bounded whatever the dataset size. Returns the files vLLM wrote, in order."""
    from vllm import SamplingParams

    def params(g: int):  # the request names its file, so the reader knows it before vLLM finishes it
        return SamplingParams(max_tokens=1, temperature=0.0,
                              extra_args={"kv_transfer_params": {"hidden_states_path": sample_path(out_dir, g)}})
    bound = max(1, int(job.get("backlog", 2))) * per_sample
    stop_file = Path(job.get("stop_file", out_dir / "stop"))
    expected = {sample_path(out_dir, g) for g in order}
    engine = llm.llm_engine
    written: list[str] = []
    nxt = 0
    while len(written) < len(order):
        queued = nxt - len(written)
        if nxt < len(order) and queued < per_sample and _pending(out_dir) <= bound:
            batch = order[nxt:nxt + per_sample - queued]
            llm.enqueue([{"prompt_token_ids": ids[g]} for g in batch], [params(g) for g in batch],
                        use_tqdm=False)
            nxt += len(batch)
            continue
        if not engine.has_unfinished_requests():  # the reader is behind: wait for it
            if stop_file.exists():
                raise RuntimeError("the reader asked the worker to stop")
            time.sleep(0.02)
            continue
        for out in engine.step():
            if not out.finished:
                continue
            path = str((out.kv_transfer_params or {}).get("hidden_states_path") or "")
            if path not in expected:
                raise RuntimeError(f"vLLM wrote a sample to {path or 'no file'}, not to a path a request "
                                   "named (allow_custom_save_path ignored?)")
            expected.discard(path)
            written.append(path)
    return written


def _wait_complete(written: list[str]) -> None:
    """Every file complete before the worker exits (and the clock stops): a shared lock on each one's lock file."""
    import fcntl

    for path in written:
        try:
            fh = open(path + ".lock")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            continue  # already read and removed by the reader
        with fh:
            fcntl.flock(fh, fcntl.LOCK_SH)


def run_job(job: dict) -> dict:
    out_dir = Path(job["out_dir"])
    result: dict = {"ok": False}
    t0 = time.perf_counter()
    try:
        import torch
        from vllm import LLM

        chunks: list[list[int]] = job["chunks"]
        ids = _read_samples(job["samples"], {g for c in chunks for g in c})
        llm = LLM(**_engine_kwargs(job, out_dir))
        result["load_s"] = round(time.perf_counter() - t0, 3)
        order = [g for c in chunks for g in c]
        t1 = time.perf_counter()
        written = _extract(llm, job, ids, order, max(1, max(len(c) for c in chunks)), out_dir)
        _wait_complete(written)
        result["extract_s"] = round(time.perf_counter() - t1, 3)
        result["tokens"] = sum(len(ids[g]) for g in order)
        if torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name(0)
        import vllm

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the result file
        msg = str(exc).strip().splitlines()
        result["error"] = f"{type(exc).__name__}: {msg[0] if msg else ''}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    # written while the engine is still alive: the reader's clock stops here, vLLM's teardown (the
    # engine core's shutdown when `llm` goes) is timed by the reader as the process's exit
    _write(out_dir / "result.json", result)
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pipeline.serving.extract JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_job(job)  # writes result.json
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
