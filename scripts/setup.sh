#!/usr/bin/env bash
# Create .venv with Python >= 3.11 (3.12 preferred) and install seqjax with its test extra.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  echo "setup.sh: no Python >= 3.11 found; set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
stamp=.venv/.seqjax-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup.sh: installing seqjax[test] into .venv (a minute or two the first time; instant once done)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "setup.sh: the test references (lm-eval's and TRL's pieces, without torch)" >&2
  # The lm-evaluation-harness pieces tests/test_lm_eval_harness.py runs (detokenizer, rolling windows, metrics)
  # import without torch: the package without its dependencies, plus sacrebleu, which its metrics module imports.
  # (sacrebleu first: installed after lm-eval, pip's resolver would list every dependency lm-eval goes without)
  .venv/bin/python -m pip install -q "sacrebleu>=2.4"
  .venv/bin/python -m pip install -q --no-deps "lm-eval==0.4.13"
  # The models' official chat templates tests/test_chat_templates.py renders with transformers: TRL ships copies
  # of them (trl/chat_templates/*.jinja). The package without its dependencies (torch); nothing of it is imported.
  .venv/bin/python -m pip install -q --no-deps "trl==1.16.0"
  echo "$want" > "$stamp"
fi
