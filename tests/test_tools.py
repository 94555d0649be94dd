"""tools/step_ratios.py: the interleaved training-step timer the step-time notes quote."""

import pytest

from tools import step_ratios


def test_step_ratios_prints_a_row_a_length_with_sdpa_at_one(capsys):
    import torch
    threads = torch.get_num_threads()
    assert step_ratios.main(["--seq-lens", "32", "--variants", "retention", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| N | sdpa | retention |" and len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "32" and cells[1].endswith("(1.00x)") and cells[2].endswith("x)")
    assert torch.get_num_threads() == threads  # timed at one thread, the caller's restored


@pytest.mark.parametrize("argv", [["--variants", "nosuch"], ["--seq-lens", "65"],
                                  ["--seq-lens", "x"], ["--rounds", "0"]])
def test_step_ratios_refuses_bad_input_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        step_ratios.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err
