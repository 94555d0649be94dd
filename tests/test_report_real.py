"""The report of a small real run made by `run_bench.py run` (sdpa and standard, 2 lengths)."""

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from harness.report import canvas
from harness.report.build import SECTIONS

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a real run: ~10 s of CPU, a worker process per case
def test_report_of_a_small_real_run(tmp_path, capsys):
    run = [sys.executable, "run_bench.py", "run", "--preset", "quick", "--variants",
           "sdpa,standard", "--seq-lens", "128,256", "--results-dir", str(tmp_path),
           "--run-id", "tiny", "--pass", "forward", "--causal", "false", "--min-run-time",
           "0.01", "--min-repeats", "3", "--inputs", "gaussian"]  # captured inputs have their own test (test_capture.py)
    p = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    folder = tmp_path / "tiny"
    # The report in-process, by the CLI's entry point: one torch start-up less.
    import run_bench

    assert run_bench.main(["report", str(folder)]) == 0
    assert "report.md" in capsys.readouterr().out
    md = (folder / "report.md").read_text()
    for title in SECTIONS:
        assert f"\n## {title}\n" in md
    assert "| sdpa " in md and "| standard " in md
    n_pass = 1  # forward only, and one input distribution
    for name in ("time_vs_length.png", "memory_vs_length.png", "error_vs_length.png"):
        img = matplotlib.image.imread(folder / "plots" / name)
        w, h = canvas.grid_size_px(n_pass, 1)
        assert img.shape[:2] == (h, w) and img[..., :3].std() > 0.01
    assert (folder / "report.html").stat().st_size > 10_000
