"""``pdserve role WORKER prefill|decode``: switch a running PD worker's role through its router's
``POST /admin/role`` (``server.router.roles``). Prints the router's answer; exit 0 once the worker
serves in its new role, 1 when the router refused or did not make the switch (its message printed),
2 when the router cannot be reached. The API key comes from ``--api-key`` or ``PDSERVE_API_KEY``."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "role",
        help="switch a PD worker between prefill and decode at runtime (through the router)",
        description="The worker leaves rotation; a decode worker migrates its requests to peer decode "
        "workers, a prefill worker finishes its prompt writes; then it serves in the new role, its "
        "weights kept loaded. Refused when it would leave a role without a ready worker.",
    )
    p.add_argument("worker", help="the worker's id, as the router's /health names it (e.g. decode-1)")
    p.add_argument("role", choices=("prefill", "decode"), help="its new role")
    p.add_argument("--router", default="http://127.0.0.1:8000", help="the router's base URL")
    p.add_argument("--api-key", default=None, help="the router's API key (default: PDSERVE_API_KEY)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the switch")


def main(args: argparse.Namespace) -> int:
    import httpx

    key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.post(
            args.router.rstrip("/") + "/admin/role",
            json={"worker": args.worker, "role": args.role},
            headers=headers,
            timeout=args.timeout,
            trust_env=False,
        )
    except httpx.HTTPError as e:
        print(f"pdserve role: router at {args.router} not reached: {e}", file=sys.stderr)
        return 2
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        print(f"pdserve role: {r.status_code}: {message}", file=sys.stderr)
        return 1
    a = r.json()
    print(f"{a['worker']}: {a['previous_role']} -> {a['role']} in {a['seconds']:.2f} s")
    return 0
