"""What a failed subprocess printed, cut to what explains it: the first traceback or fatal line
(a torchrun rank's own error sits far above the launcher's summary of who was killed), then the
tail."""

import re
import subprocess

FIRST = re.compile(
    r"^.*(Traceback \(most recent call last\)|terminate called|Error:|FAILED).*$", re.MULTILINE
)


def failure(done: subprocess.CompletedProcess, head: int = 3000, tail: int = 3000) -> str:
    text = (done.stdout or "") + (done.stderr or "")
    first = FIRST.search(text)
    if first is None or first.start() >= len(text) - tail:
        return text[-(head + tail) :]
    return f"{text[first.start() : first.start() + head]}\n[...]\n{text[-tail:]}"
