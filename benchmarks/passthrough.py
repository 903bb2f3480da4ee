"""The lean reference the gateway is compared with: a minimal aiohttp pass-through proxy that
forwards `/v1/...` to an upstream over one pooled client session and streams the reply back as it
arrives. It parses nothing and records nothing, so it is close to the floor for any Python proxy.

    python -m benchmarks.passthrough --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

from benchmarks.fake import run_loop, serve_forever

HOP_HEADERS = {"content-type", "cache-control"}  # what the reply needs; hop-by-hop headers stay behind


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(upstream, connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["client"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with app["client"].request(request.method, request.path, data=body,
                                         headers={"Content-Type": "application/json"}) as upstream_reply:
            reply = web.StreamResponse(status=upstream_reply.status, headers={
                k: v for k, v in upstream_reply.headers.items() if k.lower() in HOP_HEADERS})
            await reply.prepare(request)
            async for data in upstream_reply.content.iter_any():  # bytes as they arrive: SSE streams through
                await reply.write(data)
            await reply.write_eof()
            return reply

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A minimal aiohttp pass-through proxy (benchmark reference).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9000")
    args = parser.parse_args(argv)
    run_loop(serve_forever(make_app(args.upstream), args.port))


if __name__ == "__main__":
    main()
