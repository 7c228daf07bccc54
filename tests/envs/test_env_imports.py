"""Environments depend on the small client API (`tandem.client`) and on `tandem.envs`, never on the
orchestrator's package: importing every environment module, in a fresh interpreter, loads no
`tandem.orchestrator` module."""

import json
import subprocess
import sys
from pathlib import Path

import tandem.envs

ENVS = Path(tandem.envs.__file__).parent


def test_environments_import_no_orchestrator_module() -> None:
    modules = sorted(f"tandem.envs.{p.stem}" for p in ENVS.glob("*.py") if p.stem != "__init__")
    assert "tandem.envs.base" in modules and "tandem.envs.multi_turn" in modules
    probe = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tandem.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout)
    assert "tandem.client.inference" in loaded
    assert [m for m in loaded if m.startswith("tandem.orchestrator")] == []
