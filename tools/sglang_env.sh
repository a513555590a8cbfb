#!/usr/bin/env bash
# A CPU test environment with SGLang 0.5.23 and as many of its real Python
# dependencies as install on a CPU x86_64 machine, and torch_sdcp built (host
# backend) against SGLang's torch, so that test/test_sglang_real.py loads the
# plugin through SGLang's own plugin loader. Heavy (hundreds of MB of wheels):
# not part of the default CI.
#   tools/sglang_env.sh [VENV]        (default /tmp/sglang0523-env)
#   VENV/bin/python -m pytest -q test/test_sglang_real.py
# SGLANG_VERSION=0.5.24 builds the same for another release (then run
# test/test_sglang_conformance.py against it before trusting the plugin there).
#
# SGLang's torch pin comes first, as a CPU wheel from TORCH_INDEX (default
# PyTorch's CPU index), so that the resolver keeps it. Where that index cannot
# be reached and this machine's python3 already has the pinned torch, the venv
# sees that torch (--system-site-packages) instead of downloading another.
# Each of SGLang's requirements is then installed on its own, from wheels only:
# the ones that need CUDA to build or have no wheel for this platform are left
# out and listed at the end (and in VENV/sglang-left-out.txt) instead of
# failing the whole environment.
set -uo pipefail
venv=${1:-/tmp/sglang0523-env}
version=${SGLANG_VERSION:-0.5.23}
torch_index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
root=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
die() { echo "sglang_env.sh: $*" >&2; exit 1; }

dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
python3 -m pip download -q --no-deps -d "$dl" "sglang==$version" >/dev/null || die "cannot download sglang==$version"
metadata=$(unzip -p "$dl"/sglang-"$version"-*.whl '*/METADATA') || die "no METADATA in the sglang wheel"
torch_pin=$(sed -n 's/^Requires-Dist: torch==\([^ ;]*\).*/\1/p' <<<"$metadata" | head -1)
echo "SGLang $version pins torch ${torch_pin:?no torch pin in the SGLang wheel metadata}"

# The torch pin: the CPU wheel, else this machine's own torch when it is the pinned release.
system_torch=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
# Only that index (no configured extra index or local wheel folder may stand in for it), and only a +cpu build.
if PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps -d "$dl/torch" --index-url "$torch_index" \
        "torch==$torch_pin" >/dev/null 2>&1 && ls "$dl"/torch/torch-"$torch_pin"+cpu-*.whl >/dev/null 2>&1; then
    python3 -m venv "$venv" || die "cannot create $venv"
    "$venv/bin/python" -m pip install -q "$dl"/torch/torch-*.whl || die "cannot install the CPU torch wheel"
    echo "torch $torch_pin: CPU wheel from $torch_index"
elif [ "$system_torch" = "$torch_pin" ]; then
    python3 -m venv --system-site-packages "$venv" || die "cannot create $venv"
    echo "torch $torch_pin: $torch_index cannot be reached; the venv sees this machine's torch $system_torch"
else
    die "torch $torch_pin: $torch_index cannot be reached and this machine's torch is '${system_torch:-none}'"
fi
py="$venv/bin/python"
rm -rf "$venv/dl"

# SGLang itself, then each requirement (markers kept: pip skips those for other platforms) beside the torch pin.
"$py" -m pip install -q --no-deps "$dl"/sglang-"$version"-*.whl || die "cannot install the sglang wheel"
left_out="$venv/sglang-left-out.txt"
: >"$left_out"
installed=0 skipped=0
while IFS= read -r req; do
    name=$(sed 's/[ ;=<>!~\[].*//' <<<"$req")
    [ "$name" = torch ] && continue
    if ! "$py" -c "import sys; from pip._vendor.packaging.requirements import Requirement as R
m = R(sys.argv[1]).marker; sys.exit(0 if m is None or m.evaluate() else 1)" "$req"; then
        skipped=$((skipped + 1))  # for another platform
    elif log=$("$py" -m pip install -q --only-binary=:all: "$req" "torch==$torch_pin" 2>&1); then
        installed=$((installed + 1))
    else
        why=$(grep -E '^ERROR' <<<"$log" | head -1)
        echo "$name: ${why:-$(tail -1 <<<"$log")}" | tee -a "$left_out"
    fi
done < <(sed -n 's/^Requires-Dist: \(.*\)$/\1/p' <<<"$metadata" | grep -v 'extra ==')
"$py" -m pip install -q pytest expecttest -r "$root/requirements.txt" "torch==$torch_pin" || die "test tools"

# torch_sdcp against that torch (host backend only), with its entry points.
(cd "$root" && SDCP_NO_CUDA=1 "$py" -m pip install -q --no-build-isolation --no-deps -e .) || die "torch_sdcp"
(cd / && "$py" -c "import sglang, torch, torch_sdcp; print('SGLang', sglang.__version__, 'torch', torch.__version__,
                                                        'torch_sdcp', torch_sdcp.__file__)")
echo "$installed requirements installed, $skipped skipped by their platform markers, $(wc -l <"$left_out") left" \
     "out (listed in $left_out), $(( $(date +%s) - start )) s"
