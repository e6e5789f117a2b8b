#!/usr/bin/env bash
# The command lines of every stage of this run, as captured when they ran
# (pipeline/stages/runner.py), in pipeline order. Run from the specquant checkout.
set -euo pipefail

# data (stages/data.json)
# portable form: python -m pipeline data runs_root=/tmp/refrun/a
/work/main/.venv/bin/python -m pipeline data runs_root=/tmp/refrun/a

# cache (stages/cache.json)
# portable form: python -m pipeline cache runs_root=/tmp/refrun/a
/work/main/.venv/bin/python -m pipeline cache runs_root=/tmp/refrun/a

# cache (stages/cache-w4a16.json)
# portable form: python -m pipeline cache runs_root=/tmp/refrun/a cache.target=w4a16
/work/main/.venv/bin/python -m pipeline cache runs_root=/tmp/refrun/a cache.target=w4a16

# quantize-target (stages/quantize-target-w4a16.json)
# portable form: python -m pipeline quantize-target runs_root=/tmp/refrun/a
/work/main/.venv/bin/python -m pipeline quantize-target runs_root=/tmp/refrun/a

# quantize-drafter (stages/quantize-drafter-nvfp4.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4

# quantize-drafter (stages/quantize-drafter-nvfp4-nocalib.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4-nocalib
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4-nocalib

# quantize-drafter (stages/quantize-drafter-nvfp4a16.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4a16

# quantize-drafter (stages/quantize-drafter-nvfp4a16-gptq.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4a16-gptq
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=nvfp4a16-gptq

# quantize-drafter (stages/quantize-drafter-w4a16.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16

# quantize-drafter (stages/quantize-drafter-w4a16-gptq.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-gptq
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-gptq

# quantize-drafter (stages/quantize-drafter-w4a16-gptq-on-w4a16.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-gptq quant.calibration_target=w4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-gptq quant.calibration_target=w4a16

# quantize-drafter (stages/quantize-drafter-w4a16-imatrix.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-imatrix
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-imatrix

# quantize-drafter (stages/quantize-drafter-w4a16-imatrix-on-w4a16.json)
# portable form: python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-imatrix quant.calibration_target=w4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter runs_root=/tmp/refrun/a quant=w4a16-imatrix quant.calibration_target=w4a16

# evaluate (stages/evaluate.json)
# portable form: python -m pipeline evaluate runs_root=/tmp/refrun/a
/work/main/.venv/bin/python -m pipeline evaluate runs_root=/tmp/refrun/a
