"""Container health check: exit 0 when the service answers 200 on ``/health/ready``, else 1.

Used by the image's HEALTHCHECK and docker-compose.yml. Standard library only (it runs every few seconds), no
proxies (a proxy in the environment must not intercept a request to 127.0.0.1). ``DECONV_PORT`` names the port.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def check(port: int, timeout_s: float = 4.0) -> tuple[bool, str]:
    """GET ``/health/ready`` on 127.0.0.1:``port``: (whether it answered 200, what it said)."""
    url = f"http://127.0.0.1:{port}/health/ready"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200, f"{url}: {response.status}"
    except urllib.error.HTTPError as exc:  # 503 while starting, draining or after a failed self-test
        detail = exc.read(500).decode("utf-8", "replace")
        return False, f"{url}: {exc.code} {detail}"
    except OSError as exc:  # refused, timed out: not serving (yet)
        return False, f"{url}: {exc}"


def main() -> int:
    """Exit status for Docker: 0 healthy, 1 unhealthy (the reason goes to stderr, which Docker keeps)."""
    port = int(os.environ.get("DECONV_PORT", "8000"))
    ok, message = check(port)
    if not ok:
        sys.stderr.write(message + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
