"""Bad input to the real `sft` console script: exit code 2 and one clear line on stderr."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sft_helpers import ENV, sft_args, tiny_model  # noqa: E402

SFT = str(Path(sys.executable).parent / "sft")


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    cases = {
        "data.num_examples is 0: the training dataset is empty": ["--data.num-examples", "0"],
        "seq_len 16 is too small: an example of 16 letters takes": ["--seq-len", "16"],
        f"model.name = '{tmp_path / 'missing'}': no such directory": [
            "--model.name",
            str(tmp_path / "missing"),
        ],
    }
    procs = {
        expected: subprocess.Popen(
            [SFT, *sft_args(model, tmp_path / f"run{i}"), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i, (expected, extra) in enumerate(cases.items())
    }
    for expected, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (expected, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("sft: error: ") and expected in lines[0], lines[0]
