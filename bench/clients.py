"""Which HTTP client holds up at hundreds of calls in flight: ``python -m bench.clients``.

Starts the loopback model (``reach.fakemodel``, answering after ``--delay``) and makes
``--calls`` calls with each client, ``--in-flight`` at once: aiohttp and
``httpx.AsyncClient`` from one event loop; urllib3 and ``httpx.Client`` from that many
threads. Prints calls per second for each. This is how the example agent's client and the
baseline's were chosen (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import urllib3

from bench.processes import ROOT, free_port, wait_until

BODY = json.dumps({"messages": [{"role": "user", "content": "hello"}]})
HEADERS = {"Content-Type": "application/json"}


async def _aiohttp(url: str, calls: int, in_flight: int) -> None:
    gate = asyncio.Semaphore(in_flight)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with gate, session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()

        await asyncio.gather(*(one() for _ in range(calls)))


async def _httpx_async(url: str, calls: int, in_flight: int) -> None:
    gate = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one() -> None:
            async with gate:
                (await client.post(url, content=BODY, headers=HEADERS)).read()

        await asyncio.gather(*(one() for _ in range(calls)))


def _threads(call: Callable[[], object], calls: int, in_flight: int) -> None:
    with ThreadPoolExecutor(in_flight) as pool:
        for future in [pool.submit(call) for _ in range(calls)]:
            future.result()


def measure(url: str, calls: int, in_flight: int) -> dict[str, float]:
    pool = urllib3.PoolManager(maxsize=in_flight)
    sync_client = httpx.Client(
        limits=httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight),
        timeout=60,
    )
    runs: dict[str, Callable[[], object]] = {
        "aiohttp (one event loop)": lambda: asyncio.run(_aiohttp(url, calls, in_flight)),
        "httpx.AsyncClient (one event loop)": lambda: asyncio.run(
            _httpx_async(url, calls, in_flight)
        ),
        "urllib3 (threads)": lambda: _threads(
            lambda: pool.request("POST", url, body=BODY, headers=HEADERS), calls, in_flight
        ),
        "httpx.Client (threads)": lambda: _threads(
            lambda: sync_client.post(url, content=BODY, headers=HEADERS), calls, in_flight
        ),
    }
    found = {}
    for name, run in runs.items():
        started = time.perf_counter()
        run()
        found[name] = round(calls / (time.perf_counter() - started), 1)
    sync_client.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=500)
    parser.add_argument("--delay", type=float, default=0.5)
    args = parser.parse_args(argv)
    port = free_port()
    model = subprocess.Popen(
        [sys.executable, "-m", "reach.fakemodel", f"--port={port}", f"--delay={args.delay}"],
        cwd=ROOT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(base), timeout_s=30, what="waiting for the model")
        found = measure(f"{base}/v1/chat/completions", args.calls, args.in_flight)
    finally:
        model.terminate()
        model.wait(10)
    print(f"{args.calls} calls, {args.in_flight} in flight, model delay {args.delay}s")
    for name, per_s in found.items():
        print(f"  {name:36} {per_s:8.1f} calls/s")
    return 0


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
