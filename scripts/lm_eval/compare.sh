#!/usr/bin/env bash
# lm-eval against `strata serve` (local-completions, its defaults: token-id prompts, echo + logprobs) and
# against transformers on the same checkpoint (lm-eval's hf backend), on two local tasks: a multiple-choice
# set (acc) and a perplexity set (loglikelihood_rolling). Prints both sides' metrics and their differences.
#
#   LMEVAL_VENV=/tmp/lmeval-venv  (python -m venv it; pip install "lm-eval[api]==0.4.13" transformers)
#   scripts/lm_eval/compare.sh MODEL_DIR BASE_URL SERVED_NAME
#
# The hf side runs on this repo's .venv (its torch and transformers) with the lm-eval venv's packages on
# PYTHONPATH, so the lm-eval venv needs no torch.
set -euo pipefail
model=$1 base_url=$2 name=$3
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${LMEVAL_VENV:?set LMEVAL_VENV to a venv with lm-eval[api]==0.4.13 and transformers}
out=$(mktemp -d)
cd "$here"
"$venv/bin/lm_eval" --model local-completions --tasks strata_mc,strata_ppl --include_path . --log_samples \
  --model_args "model=$name,base_url=$base_url/v1/completions,tokenizer=$model,num_concurrent=1,max_retries=1" \
  --output_path "$out/strata"
site=$(echo "$venv"/lib/python3*/site-packages)
PYTHONPATH=$site "$repo/.venv/bin/python" -m lm_eval --model hf --model_args "pretrained=$model,dtype=float32" \
  --device cpu --tasks strata_mc,strata_ppl --include_path . --log_samples --output_path "$out/hf"
python3 "$here/compare.py" "$out/strata" "$out/hf"
