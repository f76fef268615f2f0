#!/usr/bin/env bash
# Check our seams against another verl release before moving the pin (beyond_agent/REQUIRED_VERL.txt).
#   bash scripts/try_verl.sh 0.9.1 [pytest args]
# Builds a scratch copy of .venv beside it (hard links: seconds, almost no disk), installs verl==VERSION from the
# package index into the copy only (no dependencies: verl's core requirements are checked, not changed), then
# prints the seam table of `python -m beyond_agent.seams` against that verl and runs the seam contract tests
# (tests/foundation/test_verl_seams_on_cpu.py, tests/trainer/test_trainer_seams_on_cpu.py; more with pytest args,
# e.g. a training test: the pin check lets VERSION start one, with a warning). Our code is this checkout's: the
# copy imports it as .venv does. .venv is not touched.
# Exit status: the tests'. The scratch venv stays in .venv-verl-VERSION (git-ignored) for more runs; delete it
# when done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version="${1:?usage: bash scripts/try_verl.sh VERSION [pytest args], e.g. 0.9.1}"
shift
scratch=".venv-verl-${version}"
bash scripts/install.sh
if [ ! -x "$scratch/bin/python" ]; then
  cp -al .venv "$scratch"  # hard links: the install below replaces verl's files in the copy, never in .venv
fi
.venv/bin/uv pip install --quiet --python "$scratch/bin/python" --no-deps "verl==${version}"
echo "try_verl.sh: verl $("$scratch/bin/python" -c 'from importlib import metadata; print(metadata.version("verl"))') \
in $scratch, against the pinned $(sed -n 's/^version=//p' beyond_agent/REQUIRED_VERL.txt)"
export BEYOND_AGENT_TRYING_VERL="$version"  # beyond_agent.verl_pin lets this release start a training
"$scratch/bin/python" -m beyond_agent.seams || echo "try_verl.sh: some seams do not hold with verl ${version} (above)"
"$scratch/bin/python" -m pytest -q -p no:randomly tests/foundation/test_verl_seams_on_cpu.py \
  tests/trainer/test_trainer_seams_on_cpu.py "$@"
