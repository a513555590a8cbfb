#!/usr/bin/env bash
# A CPU test environment with vLLM and its real Python dependencies, and
# torch_sdcp built (host backend) against the environment's torch, so that
# test/test_vllm_real.py loads the plugin through vLLM's own
# load_general_plugins. Heavy (several GiB of wheels): not part of the default
# CI.
#   tools/vllm_env.sh [VENV]          (default /tmp/vllm033-env)
#   VENV/bin/python -m pytest -q test/test_vllm_real.py test/test_vllm_lifecycle.py
# VLLM_VERSION picks the release (0.33.0 by default; 0.34.0 is the other
# supported one: VLLM_VERSION=0.34.0 tools/vllm_env.sh /tmp/vllm034-env), or a
# patch release (then run test/test_vllm_conformance.py against it before
# trusting the plugin there).
#
# A pinned requirement (name==version) that the package index lacks (0.34.0
# pins flashinfer-python==0.7.3, which the index here does not have) is
# replaced by the newest release of that package the index has, installed
# --no-deps; the script prints one line per such replacement.
#
# torch: the venv sees this Python's site-packages. When the torch there has
# vLLM's pinned major.minor (0.33.0 pins 2.14.0), it is used as is (a patch
# release apart, e.g. 2.14.1); otherwise the pin is installed from PyPI (a
# CUDA build of several GiB). vLLM itself goes in without its torch, torchaudio
# and torchvision pins; every other requirement is installed as vLLM states it,
# CUDA packages included (humming-kernels[cu13] puts CUDA 13.5 headers into
# site-packages/nvidia/cu13/include: the environment of the build check).
set -euo pipefail
venv=${1:-/tmp/vllm033-env}
version=${VLLM_VERSION:-0.33.0}
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv --system-site-packages "$venv"
py="$venv/bin/python"
"$py" -m pip download -q --no-deps -d "$venv/dl" "vllm==$version"
wheel=$(ls "$venv"/dl/vllm-"$version"-*.whl)
unzip -p "$wheel" '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' > "$venv/vllm-requires.txt"
torch_pin=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$venv/vllm-requires.txt")
have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo none)
echo "vLLM $version pins torch ${torch_pin:?no torch pin in the vLLM wheel metadata}; this Python has torch $have"
if [[ ${have%.*} != "${torch_pin%.*}" ]]; then
  "$py" -m pip install -q "torch==$torch_pin"
fi
grep -Ev '^(torch|torchaudio|torchvision)([=<>! ;]|$)' "$venv/vllm-requires.txt" > "$venv/vllm-requires-no-torch.txt"
: > "$venv/vllm-requires-resolvable.txt"
: > "$venv/vllm-requires-unresolvable.txt"
while IFS= read -r req; do
  spec=${req%%;*}
  spec=${spec// /}
  name=${spec%%==*}
  name=${name%%[*}
  if [[ $spec == *==* ]] && ! "$py" -m pip index versions "$name" 2>/dev/null | sed -n 's/^Available versions: //p' \
      | tr ',' '\n' | tr -d ' ' | grep -qxF "${spec##*==}"; then
    echo "$name" >> "$venv/vllm-requires-unresolvable.txt"
    echo "vLLM $version pins $spec, which the package index lacks: the newest $name it has goes in --no-deps"
  else
    echo "$req" >> "$venv/vllm-requires-resolvable.txt"
  fi
done < "$venv/vllm-requires-no-torch.txt"
"$py" -m pip install -q -r "$venv/vllm-requires-resolvable.txt" pytest expecttest
if [[ -s "$venv/vllm-requires-unresolvable.txt" ]]; then
  "$py" -m pip install -q --no-deps -r "$venv/vllm-requires-unresolvable.txt"
fi
"$py" -m pip install -q --no-deps "$wheel"
# torch_sdcp against that torch (host backend only), with its entry points.
(cd "$root" && SDCP_NO_CUDA=1 "$py" -m pip install --no-build-isolation --no-deps -e .)
"$py" -c "import vllm, torch, torch_sdcp; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
