#!/usr/bin/env bash
# A CPU test environment with vLLM 0.33.0 and its real Python dependencies,
# and torch_sdcp built (host backend) against vLLM's torch, so that
# test/test_vllm_real.py loads the plugin through vLLM's own
# load_general_plugins. Heavy (vLLM pins torch 2.14.0 and pulls several GiB of
# wheels): not part of the default CI.
#   tools/vllm_env.sh [VENV]          (default /tmp/vllm033-env)
#   VENV/bin/python -m pytest -q test/test_vllm_real.py test/test_vllm_lifecycle.py
# VLLM_VERSION=0.33.1 builds the same for a patch release (then run
# test/test_vllm_conformance.py against it before trusting the plugin there).
set -euo pipefail
venv=${1:-/tmp/vllm033-env}
version=${VLLM_VERSION:-0.33.0}
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# vLLM's torch pin, as a CPU wheel, first: the resolver then keeps it.
torch_pin=$("$py" -m pip download -q --no-deps -d "$venv/dl" "vllm==$version" >/dev/null &&
            unzip -p "$venv"/dl/vllm-"$version"-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: torch==\([^ ;]*\).*/\1/p' | head -1)
echo "vLLM $version pins torch ${torch_pin:?no torch pin in the vLLM wheel metadata}"
"$py" -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==$torch_pin"
"$py" -m pip install -q "vllm==$version" "torch==$torch_pin" pytest expecttest
"$py" -m pip install -q -r "$root/requirements.txt"
# torch_sdcp against that torch (host backend only), with its entry points.
(cd "$root" && SDCP_NO_CUDA=1 "$py" -m pip install --no-build-isolation --no-deps -e .)
"$py" -c "import vllm, torch, torch_sdcp; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
