"""Run the supervisor over process specs from a JSON file (for tests that signal the launcher).

python supervise_json.py SPECS.json LOG_DIR GRACE_S [RUN_DIR]

With RUN_DIR it holds RUN_DIR/rl.lock while it runs and passes it to its children, as `rl` does.
"""

import contextlib
import json
import sys
from pathlib import Path

from tandem.launch.supervisor import ProcessSpec, Supervisor
from tandem.transport.layout import run_dir_lock

if __name__ == "__main__":
    specs = [ProcessSpec(**s) for s in json.loads(Path(sys.argv[1]).read_text())]
    with run_dir_lock(Path(sys.argv[4])) if len(sys.argv) > 4 else contextlib.nullcontext() as lock:
        fds = () if lock is None else (lock,)
        sys.exit(
            Supervisor(specs, Path(sys.argv[2]), shutdown_grace_s=float(sys.argv[3]), pass_fds=fds).run()
        )
