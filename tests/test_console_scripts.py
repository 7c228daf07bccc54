"""tandem's console scripts stay tandem's with the optional extras installed: no other installed
distribution declares a script of the same name (verifiers ships `eval`, `debug`, `init`,
`validate`, ...), and each script in the environment's bin folder calls tandem's entry point."""

import importlib.metadata as md
import subprocess
import sysconfig
from pathlib import Path

import pytest

SCRIPT_GROUPS = ("console_scripts", "gui_scripts")


def tandem_scripts() -> list[md.EntryPoint]:
    return [ep for ep in md.distribution("tandem").entry_points if ep.group in SCRIPT_GROUPS]


def test_no_installed_distribution_declares_a_tandem_script_name() -> None:
    pytest.importorskip("verifiers", reason="the verifiers extra is what used to take `eval`")
    names = {ep.name for ep in tandem_scripts()}
    assert "evaluate" in names and "rl" in names
    clashes = {
        ep.name: dist.metadata["Name"]
        for dist in md.distributions()
        if dist.metadata["Name"] != "tandem"
        for ep in dist.entry_points
        if ep.group in SCRIPT_GROUPS and ep.name in names
    }
    assert clashes == {}


def test_installed_scripts_call_tandem_entry_points() -> None:
    bin_dir = Path(sysconfig.get_path("scripts"))
    for ep in tandem_scripts():
        script = bin_dir / ep.name
        assert script.is_file(), f"{script} is missing"
        assert f"from {ep.module} import {ep.attr}" in script.read_text(), f"{script} is not tandem's"
    evaluate = subprocess.run(
        [str(bin_dir / "evaluate"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert evaluate.returncode == 0 and evaluate.stdout.startswith("usage: evaluate"), evaluate.stderr
