""".ci/run's control flow, with its tools stubbed: it fails when Slurm cannot start (CI
installs Slurm itself, so the sharded-run tests must not quietly skip there), and runs
pytest with ATTNBENCH_REQUIRE_SLURM=1 when it does start."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run_ci(tmp_path: Path, slurm_starts: bool) -> tuple[subprocess.CompletedProcess, str]:
    repo, stubs = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    stubs.mkdir()
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    log = tmp_path / "calls.log"
    start = 'echo "export SLURM_CONF=/nowhere/slurm.conf"' if slurm_starts else \
        'echo "slurm.sh: apt-get failed" >&2; exit 1'
    _script(repo / ".ci" / "slurm.sh",
            f'echo "slurm.sh $1" >>{log}\ncase "$1" in start) {start} ;; esac\n')
    # python3 -m venv .venv: an activate script that changes nothing
    _script(stubs / "python3", 'mkdir -p .venv/bin && : >.venv/bin/activate\n')
    _script(stubs / "pip", f'echo "pip $*" >>{log}\n')
    _script(stubs / "python", f'echo "python $* REQUIRE=${{ATTNBENCH_REQUIRE_SLURM:-}}" >>{log}\n')
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", ".ci/run"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=60)
    return r, log.read_text() if log.exists() else ""


def test_ci_fails_when_slurm_cannot_start(tmp_path):
    r, calls = _run_ci(tmp_path, slurm_starts=False)
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Slurm did not start" in r.stderr
    assert "-m pytest" not in calls  # no test run that would skip the Slurm tests
    assert "slurm.sh stop" in calls  # the trap still stops what was started


def test_ci_runs_the_tests_requiring_slurm_when_it_starts(tmp_path):
    r, calls = _run_ci(tmp_path, slurm_starts=True)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "python -m pytest REQUIRE=1" in calls
    # the README's install: the optional extras too, so an installed extra is tested
    assert "pip install -e .[test,xformers]" in calls
