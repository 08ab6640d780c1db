"""Target ("decode side") processes for the two-process transport tests and the dead-peer driver.

``spawn_target`` starts one ``multiprocessing`` spawn child that creates a transport, registers a
zeroed pool, sends its metadata back and then polls notifications until told ``("bye",)``; it
verifies its pool on ``("check", src, dst, n)`` (``check``) and stops polling for a while on
``("pause", seconds)``. The child exits on its own after 60 s or when its parent goes away.
"""

from __future__ import annotations

import time

import torch

from tests.support.transport_pools import PAGE_BYTES, expected_page, make_pool, page_words
from transfer.factory import create_transport


def _target(conn, backend: str, name: str, opts: dict) -> None:
    """Decode side: register a zeroed pool, publish metadata, poll notifications, verify on request."""
    t = create_transport(backend, name, **opts)
    buf = make_pool()
    t.register_pool(buf, PAGE_BYTES)
    conn.send_bytes(t.local_metadata())
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got += t.poll_notifs()
        if conn.poll():
            cmd = conn.recv()  # EOFError once the parent is gone: the child ends
            if cmd[0] == "bye":
                break
            if cmd[0] == "pause":  # alive but not polling (a hung scheduler)
                time.sleep(cmd[1])
                continue
            _, src, dst, n_expected = cmd  # ("check", ...): wait for the notifs, then verify
            until = time.monotonic() + 10
            while len(got) < n_expected and time.monotonic() < until:
                got += t.poll_notifs()
                time.sleep(0.0005)
            quiet = time.monotonic() + 0.2  # any duplicate would show up here
            while time.monotonic() < quiet:
                got += t.poll_notifs()
                time.sleep(0.001)
            where = dict(zip(dst, src))
            bad = [
                i
                for i in range(buf.shape[0])
                if not torch.equal(
                    page_words(buf, i), expected_page(where[i]) if i in where else torch.zeros_like(page_words(buf, i))
                )
            ]
            conn.send({"notifs": got, "bad_pages": bad, "lane_writes": getattr(t, "lane_writes", None)})
            got = []
        time.sleep(0.0005)
    t.close()


def spawn_target(ctx, backend: str, name: str, opts: dict):
    """``(process, pipe, metadata)`` of a started target; ``AssertionError`` if it published no
    metadata within 30 s (the process is killed then)."""
    (started,) = spawn_targets(ctx, backend, [name], opts)
    return started


def spawn_targets(ctx, backend: str, names: list[str], opts: dict) -> list[tuple]:
    """``spawn_target`` for each of ``names``, the processes started together (their start-ups
    overlap) and each one's metadata awaited after."""
    started = []
    for name in names:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_target, args=(child, backend, name, opts), daemon=True)
        p.start()
        started.append((p, parent))
    out = []
    for p, parent in started:
        if not parent.poll(30):
            for q, _ in started:
                q.kill()
            raise AssertionError(f"{backend} target process published no metadata within 30 s")
        out.append((p, parent, parent.recv_bytes()))
    return out


def reap(p) -> None:
    """Kill ``p`` if it still runs and wait for it (at most 5 s)."""
    if p.is_alive():
        p.kill()
    p.join(5)


def check(conn, src, dst, n_notifs: int) -> dict:
    """Ask the target to verify its pool against ``dst[i] <- src[i]`` once ``n_notifs`` arrived:
    ``{"notifs": [(sender, notif), ...], "bad_pages": [page ids with wrong bytes], "lane_writes": the
    ucxx target's writes received over its copy lanes so far (None for other backends)}``."""
    conn.send(("check", list(map(int, src)), list(map(int, dst)), n_notifs))
    assert conn.poll(20), "target did not report"
    return conn.recv()
