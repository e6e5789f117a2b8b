#!/usr/bin/env bash
# The command lines of every stage of this run, as captured when they ran
# (pipeline/stages/runner.py), in pipeline order. Run from the specquant checkout.
set -euo pipefail

# data (stages/data.json)
# portable form: python -m pipeline data
/work/main/.venv/bin/python -m pipeline data

# cache (stages/cache.json)
# portable form: python -m pipeline cache
/work/main/.venv/bin/python -m pipeline cache

# quantize-drafter (stages/quantize-drafter-nvfp4.json)
# portable form: python -m pipeline quantize-drafter quant=nvfp4
/work/main/.venv/bin/python -m pipeline quantize-drafter quant=nvfp4

# quantize-drafter (stages/quantize-drafter-nvfp4-nocalib.json)
# portable form: python -m pipeline quantize-drafter quant=nvfp4-nocalib
/work/main/.venv/bin/python -m pipeline quantize-drafter quant=nvfp4-nocalib

# quantize-drafter (stages/quantize-drafter-nvfp4a16.json)
# portable form: python -m pipeline quantize-drafter quant=nvfp4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter quant=nvfp4a16

# quantize-drafter (stages/quantize-drafter-w4a16.json)
# portable form: python -m pipeline quantize-drafter quant=w4a16
/work/main/.venv/bin/python -m pipeline quantize-drafter quant=w4a16

# quantize-target (stages/quantize-target-w4a16.json)
# portable form: python -m pipeline quantize-target
/work/main/.venv/bin/python -m pipeline quantize-target

# evaluate (stages/evaluate.json)
# portable form: python -m pipeline evaluate
/work/main/.venv/bin/python -m pipeline evaluate
