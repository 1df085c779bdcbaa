"""Read one metrics endpoint, bounded: a deadline for the whole exchange (a slow drip
ends there), a cap on the body's bytes (decompressed), and a plain reason for every way
it can fail, for the status to name."""

from __future__ import annotations

import asyncio

import aiohttp

CHUNK = 64 * 1024
# In the reason for a read that ran out of time (reads.py tells these apart: a reading
# process that itself waited for the CPU makes them its fault, not the pod's).
DEADLINE_MISSED = "did not answer in full within"


async def fetch(session: aiohttp.ClientSession, url: str, timeout_s: float,
                max_bytes: int, accept: str = "text/plain;version=0.0.4"
                ) -> tuple[str | None, str | None]:
    """(page text, None) or (None, why not)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, headers={"Accept": accept,
                                                 "Accept-Encoding": "identity"},
                                   allow_redirects=False) as resp:
                if resp.status != 200:
                    return None, f"{url} answered HTTP {resp.status}"
                if resp.content_length is not None and resp.content_length > max_bytes:
                    return None, (f"{url} offers a {resp.content_length}-byte page, over the "
                                  f"{max_bytes}-byte cap")
                body = bytearray()
                async for chunk in resp.content.iter_chunked(CHUNK):
                    body += chunk
                    if len(body) > max_bytes:
                        return None, f"{url} sent more than the {max_bytes}-byte cap"
                return body.decode("utf-8", errors="replace"), None
    except TimeoutError:
        return None, f"{url} {DEADLINE_MISSED} {timeout_s:g} s"
    except aiohttp.ClientConnectorError as err:
        return None, f"{url}: port closed or unreachable ({err.os_error or err})"
    except (aiohttp.ClientError, UnicodeError, ValueError) as err:
        return None, f"{url}: {type(err).__name__}: {str(err)[:120]}"
