"""Stand-ins for the run's processes, used by the supervisor tests.

python children.py service PORT            serve GET /health on 127.0.0.1:PORT until SIGTERM
python children.py job NAME LINES CODE S   print LINES numbered lines, sleep S seconds, exit CODE
python children.py stubborn PIDFILE        ignore SIGTERM, write own pid, sleep forever
python children.py tidy FILE S             on SIGTERM take S seconds to clean up, write FILE, exit 0
python children.py spawner PIDFILE         start a grandchild in the same group, write both pids
"""

import http.server
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main(mode: str, *args: str) -> None:
    if mode == "service":
        print(f"service listening on {args[0]}", flush=True)
        http.server.HTTPServer(("127.0.0.1", int(args[0])), Health).serve_forever()
    elif mode == "job":
        name, lines, code, seconds = args[0], int(args[1]), int(args[2]), float(args[3])
        for i in range(lines):
            print(f"{name} line {i}", flush=True)
        time.sleep(seconds)
        sys.exit(code)
    elif mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(args[0]).write_text(str(os.getpid()))
        print("ignoring SIGTERM", flush=True)
        time.sleep(3600)
    elif mode == "tidy":

        def clean_up(*_: object) -> None:
            time.sleep(float(args[1]))
            Path(args[0]).write_text("cleaned up")
            sys.exit(0)

        signal.signal(signal.SIGTERM, clean_up)
        print("running", flush=True)
        time.sleep(3600)
    elif mode == "spawner":
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        Path(args[0]).write_text(f"{os.getpid()} {grandchild.pid}")
        print("spawned", grandchild.pid, flush=True)
        time.sleep(3600)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
