"""The routes through which a prefill server hands a prompt's keys and values to a decode server
(`[inference.prefill]`; the decode side is prefill.py).

POST /v1/kv/export computes a prompt (prefix-cache hits included) and answers its reusable
blocks after `skip_tokens`: in the body, or in a staging buffer that the decode server reads and
then releases (/v1/kv/release), or sent over a link (/v1/kv/link, /v1/kv/send, /v1/kv/unlink;
engine/kv_link.py). The blocks come from the prefix cache, so a server with it off refuses.
"""

import base64
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.inference.engine.api import SamplingParams
from tandem.inference.errors import APIError
from tandem.inference.http import FastJSONResponse, read_body
from tandem.inference.protocol import KVExportRequest, KVReleaseRequest, KVSendRequest, KVUnlinkRequest

if TYPE_CHECKING:
    from tandem.inference.server import Server

log = logging.getLogger("tandem.inference")

PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1)
"""What POST /v1/kv/export asks of the engine: the prompt computed, one token drawn and dropped."""


def add_kv_routes(app: FastAPI, server: "Server") -> None:
    engine, config = server.engine, server.config

    def require_prefix_cache() -> None:
        if not config.engine.prefix_caching:
            raise APIError(
                400, "this server's prefix cache is off (engine.prefix_caching): it keeps no blocks"
            )

    @app.post("/v1/kv/export")
    async def export_kv(request: Request) -> Response:
        """Compute a prompt (prefix-cache hits included) and answer its reusable blocks' keys and
        values after `skip_tokens`, for a decode server (prefill.py, engine/kv_prefix.py)."""
        req = await read_body(request, KVExportRequest)
        require_prefix_cache()
        server.check_prompt_ids(req.prompt)
        if req.skip_tokens % config.engine.block_size:
            raise APIError(
                400,
                f"skip_tokens must be a multiple of the block size {config.engine.block_size} "
                f"(got {req.skip_tokens})",
                "skip_tokens",
            )
        await server.wait_until_resumed(request)
        try:
            async with aclosing(
                engine.generate(server.new_request_id("kv"), req.prompt, PREFILL_ONLY, stream=False)
            ) as updates:
                async for _ in updates:
                    pass
            lent = server.staging.lend() if req.staged else None
            if lent is not None:
                buffer, lease = lent
                try:
                    staged = await engine.export_prompt_staged(req.prompt, req.skip_tokens, buffer)
                except ValueError as e:  # (too large for a buffer: the body carries it)
                    server.staging.release(buffer, lease)
                    log.debug("export not staged: %s", e)
                else:
                    staged["handle"] = base64.b64encode(staged["handle"]).decode()
                    server.counters.kv_exports_total += 1
                    server.counters.kv_exports_staged_total += 1
                    return FastJSONResponse({"staged": staged, "lease": lease})
            data = await engine.export_prompt(req.prompt, req.skip_tokens)
        except ValueError as e:
            raise APIError(400, f"cannot prefill this prompt: {e}", "prompt") from None
        server.counters.kv_exports_total += 1
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/kv/release")
    async def release_kv(request: Request) -> dict:
        """A decode server is done with the staging buffer of an export (prefill.py)."""
        req = await read_body(request, KVReleaseRequest)
        return {"released": server.staging.release(req.buffer, req.lease)}

    @app.post("/v1/kv/link")
    async def open_kv_link() -> dict:
        """A link for a decode server whose blocks travel by `p2p` (engine/kv_link.py)."""
        require_prefix_cache()
        return await engine.open_link()

    @app.post("/v1/kv/send")
    async def send_kv(request: Request) -> dict:
        """Send a staged export's blocks over a link; answered once the send is queued."""
        req = await read_body(request, KVSendRequest)
        if not server.staging.holds(req.buffer, req.lease):
            raise APIError(400, f"lease {req.lease} does not hold staging buffer {req.buffer}", "lease")
        try:
            await engine.send_staged(req.link, req.buffer, req.nbytes, req.lease)
        except (ValueError, RuntimeError) as e:
            raise APIError(400, f"cannot send: {e}", "link") from None
        server.counters.kv_sends_total += 1
        return {"sent": req.nbytes}

    @app.post("/v1/kv/unlink")
    async def close_kv_link(request: Request) -> dict:
        req = await read_body(request, KVUnlinkRequest)
        await engine.close_link(req.link)
        return {"closed": req.link}
