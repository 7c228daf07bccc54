"""Entry-point wrapper: a user's mistake becomes one clear line on stderr and a non-zero exit."""

import sys
from collections.abc import Callable

from tandem.config.loader import ConfigError


class UserError(RuntimeError):
    """An error caused by the user's input (a path, a dataset, a setting), reported in one line."""


def run_cli(main: Callable[[], object], prog: str) -> None:
    """Run `main`; ConfigError/UserError print `prog: error: ...` and exit 2; Ctrl-C exits 130."""
    try:
        main()
    except (ConfigError, UserError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
