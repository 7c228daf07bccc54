"""`uv run inference @ cfg.toml` / `uv run inference --model PATH`: start the inference server.

`backend` picks the engine: native (tandem's own, CPU and GPU), vllm (a vLLM subprocess behind
tandem's front), or auto (vllm when it imports and CUDA is present, else native).
"""

import gc
import importlib.util
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.cli import UserError, run_cli
from tandem.config.loader import parse_config
from tandem.inference.config import InferenceConfig

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

PROG = "inference"


def expand_aliases(argv: Sequence[str]) -> list[str]:
    """`--model PATH` is short for `--model.name PATH`."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args) and not args[i + 1].startswith("--"):
            args[i] = "--model.name"
        elif arg.startswith("--model="):
            args[i] = "--model.name=" + arg.removeprefix("--model=")
    return args


def pick_backend(config: InferenceConfig) -> str:
    if config.backend != "auto":
        return config.backend
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "native"


def freeze_heap() -> None:
    """Move everything alive after start-up (modules, the model) out of the garbage collector's
    sight. Those objects live as long as the server, and a full collection walking the ~10^6 of
    them stalls the engine thread, holding the GIL, for a few hundred milliseconds."""
    gc.collect()
    gc.freeze()


KEEP_ALIVE_S = 75


def http_server(app: "ASGIApp", config: InferenceConfig) -> "uvicorn.Server":
    """uvicorn serving `app` as configured; set its `should_exit` to stop it from another thread.

    Idle connections are kept open for 75 s, well past the clients' own 5 s expiry (httpx's and
    openai's default): with both at 5 s, a client could send on a connection in the instant the
    server closed it, and the request failed with a connection error (seen in RL runs whose
    steps wait ~5 s for the trainer)."""
    import uvicorn

    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )


def serve_native(config: InferenceConfig) -> None:
    from tandem.inference.engine import start_engine, uses_core_process
    from tandem.inference.server import build_app

    engine = start_engine(config)  # (with an in-memory weights.transport, its receiver joins the trainer)
    app = build_app(engine, engine.tokenizer, config)
    freeze_heap()
    log = logging.getLogger("tandem.inference")
    log.info(
        "serving %s (native engine%s, max_model_len %d) on http://%s:%d",
        config.served_model_name or config.model.name,
        ", its core in a process of its own" if uses_core_process(config) else "",
        engine.max_model_len,
        config.host,
        config.port,
    )
    server = http_server(app, config)
    engine.on_death = lambda: setattr(server, "should_exit", True)  # uvicorn polls the flag
    server.run()
    if engine.dead_reason is not None:
        raise UserError(f"the inference engine died ({engine.dead_reason}; traceback above); server stopped")


def check_prefill(config: InferenceConfig) -> None:
    """Refuse `prefill.servers` where this server could not take their keys and values."""
    if pick_backend(config) == "vllm":
        raise UserError(
            "prefill.servers: prefill on other servers needs the native engine (backend = "
            '"native"); the vLLM backend cannot take keys and values from another server'
        )
    if not config.engine.prefix_caching:
        raise UserError(
            "prefill.servers needs engine.prefix_caching: the prompts' keys and values from the "
            "prefill servers enter this server through its prefix cache"
        )


def serve(config: InferenceConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.prefill.servers:
        check_prefill(config)
    if pick_backend(config) == "vllm":
        from tandem.inference.vllm.serve import serve_vllm

        serve_vllm(config)
    else:
        serve_native(config)


def main(argv: Sequence[str] | None = None) -> None:
    def run() -> None:
        args = expand_aliases(sys.argv[1:] if argv is None else argv)
        serve(parse_config(InferenceConfig, args, prog=PROG))

    run_cli(run, PROG)


if __name__ == "__main__":
    main()
