"""The `inference` command line: TOML config, the --model alias, and one-line user errors."""

import subprocess
import sys
from pathlib import Path

from tandem.inference.cli import expand_aliases


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.inference.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_model_alias() -> None:
    assert expand_aliases(["--model", "m", "--port", "1"]) == ["--model.name", "m", "--port", "1"]
    assert expand_aliases(["--model=m"]) == ["--model.name=m"]
    assert expand_aliases(["--model.dtype", "float32"]) == ["--model.dtype", "float32"]


def test_toml_config_and_overrides_dry_run(tmp_path: Path) -> None:
    config = tmp_path / "inference.toml"
    config.write_text('port = 9001\napi-key = "k"\n[model]\nname = "some/model"\n[engine]\nmax-n = 4\n')
    result = run_cli("@", str(config), "--engine.max-model-len", "512", "--model", "other/model", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert 'name = "other/model"' in result.stdout and "port = 9001" in result.stdout
    assert "max_n = 4" in result.stdout and "max_model_len = 512" in result.stdout


def test_user_errors_are_one_line_with_exit_code_2(tmp_path: Path) -> None:
    for args, expected in [
        (["--engine.max-n", "0"], "engine.max_n"),
        (["--nonsense", "1"], "unknown key 'nonsense'"),
        (["--model", str(tmp_path / "missing"), "--backend", "native"], "no such directory"),
    ]:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("inference: error:") and expected in lines[0], lines
