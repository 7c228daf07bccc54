"""Run the supervisor over process specs from a JSON file (for tests that signal the launcher).

python supervise_json.py SPECS.json LOG_DIR GRACE_S
"""

import json
import sys
from pathlib import Path

from tandem.launch.supervisor import ProcessSpec, Supervisor

if __name__ == "__main__":
    specs = [ProcessSpec(**s) for s in json.loads(Path(sys.argv[1]).read_text())]
    sys.exit(Supervisor(specs, Path(sys.argv[2]), shutdown_grace_s=float(sys.argv[3])).run())
