#!/usr/bin/env bash
# The tests whose outcome depends on the MCore version, against megatron-core 0.19.2 (the GPU
# hosts' version) in a Python 3.12 virtual environment, beside the default run's 0.16.1 on
# Python 3.11: the unit tests that import MCore and the gloo (`dist`) files that run MCore's
# models, groups, schedules and losses. Version-conditioned strict xfails are judged on both
# versions (an XPASS fails either run). CI runs it after the README's test command.
# Usage: bash scripts/test-mcore-019.sh [pytest args]   (PYTHON312: the interpreter, default python3.12
# or pyenv's 3.12; the environment lives in .venv-mcore019/, which git ignores)
set -euo pipefail
cd "$(dirname "$0")/.."
# The first that runs: $PYTHON312, python3.12 on PATH (a pyenv shim there may not run), pyenv's 3.12.
py=
for candidate in "${PYTHON312:-}" python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
  [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" >/dev/null 2>&1 && { py=$candidate; break; }
done
[ -n "$py" ] || { echo "test-mcore-019: no Python 3.12 that runs (set PYTHON312)" >&2; exit 2; }
venv=.venv-mcore019
if ! "$venv/bin/python" -c "import torch, megatron.core as m, cpkit, pytest; assert m.__version__.split('+')[0] == '0.19.2'" 2>/dev/null; then
  echo "test-mcore-019: setting up $venv (Python 3.12, torch, megatron-core 0.19.2, cpkit[test]; a few minutes the first time)"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch>=2.6" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -m pip install -q -e ".[test]" "megatron-core==0.19.2" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$venv/bin/python" -c "from cpkit.notices import quiet_known_notices; quiet_known_notices(); import torch, megatron.core as m; print('test-mcore-019: torch', torch.__version__, '| megatron-core', m.__version__)"
units=(tests/test_attention_module.py tests/test_cpu_shim.py tests/test_dynamic_mcore.py tests/test_eval_cp.py
  tests/test_eval_cp_protocol.py tests/test_groups.py tests/test_layout.py tests/test_models.py tests/test_strict_xfails.py
  tests/test_upstream_xfail.py)
dist=(functional/test_attention_module.py functional/test_dynamic_cp.py functional/test_dynamic_failures.py
  functional/test_dynamic_p2p_shapes.py functional/test_dynamic_pipeline.py functional/test_eval_cp.py functional/test_gpt.py
  functional/test_gpt_features.py functional/test_groups.py functional/test_hierarchical.py functional/test_loss_matrix.py
  functional/test_loss_matrix_dynamic.py functional/test_mcore_hybrid_cp.py
  functional/test_mcore_hybrid_model.py)
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q "${units[@]}" "${dist[@]}" -m "not (gpu1 or gpu2 or gpu4)" "$@"
