#!/usr/bin/env bash
# The README's test command runs this (through `make test`): start the services the suite needs,
# then run pytest in parallel. Exit code 5 (no tests collected) is an error: it means the
# selection is empty, which must never pass silently.
set -uo pipefail
cd "$(dirname "$0")/.."
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1
if [ -x jobs/slurm/local-cluster.sh ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
  # Here the cluster can run, so Slurm tests must not skip: the fixture fails instead.
  export WORKBENCH_REQUIRE_SLURM=1
  timeout 600 jobs/slurm/local-cluster.sh || echo "local Slurm cluster did not start (the slurm tests will fail)"
fi
# Browser tests (marker browser) drive Debian's Chromium through Playwright (whose own browser
# download cannot work offline): install both when missing; they skip only where this cannot.
.venv/bin/python -c "import playwright" 2>/dev/null ||
  .venv/bin/python -m pip install -q -c constraints.txt playwright || echo "playwright did not install"
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
  apt_install() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends chromium >/dev/null; }
  apt_install || { timeout 300 apt-get update -q >/dev/null && apt_install; } ||
    echo "chromium did not install; browser tests will fail"
fi
# Tests write only to temporary or ignored folders: the clone's status must be the same after.
status() { git status --porcelain --untracked-files=normal 2>/dev/null; }
before=$(status)
# --durations: the slowest tests end every log, so a run that nears CI's limit says where the
# time went. --dist load, not loadgroup (the suite has no xdist groups): xdist 3.8's loadgroup and
# loadscope schedulers stop handing out tests once a crashed worker is replaced, so one test that
# pytest-timeout ends would hold the whole run until CI's limit (tests/test_suite_timeout.py).
# A run that outlasts 75 minutes (CI allows 90 with the set-up) names the tests still running and
# ends with pytest's summary (tests/conftest.py), instead of being killed with no names.
WORKBENCH_SUITE_LIMIT_S="${WORKBENCH_SUITE_LIMIT_S:-4500}" \
  .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist load --durations=25 "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests"; fi
after=$(status)
if [ "$before" != "$after" ]; then
  echo "the test run modified the clone (git status before/after differ):"
  diff <(echo "$before") <(echo "$after")
  [ "$rc" = 0 ] && rc=1
fi
exit $rc
