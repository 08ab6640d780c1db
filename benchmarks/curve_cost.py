"""What CURVE costs the control plane: round-trip time and one-way throughput of real control
messages over loopback, plain ZMTP against CURVE with a cluster key (``transfer.control_auth``, the
sockets' exact configuration: a ZAP-checked CURVE server, a CURVE client).

Two message sizes: a ``GenerateRequest`` as a router sends it (sampling params and a
``--prompt-tokens`` prompt frame) and a heartbeat-sized one (``StatsRequest``). Both pairs (DEALER
-> ROUTER, echoing) run in this process, each on its own context with its own I/O thread; the
configurations are interleaved round by round (plain, CURVE, plain, ...) so a load change on the
machine hits both alike. Round trip: min and median over ``--repeat`` rounds of ``--rtt-batch``
sequential echoes each (microseconds per echo). Throughput: ``--burst`` messages sent back to back,
the server acknowledging the last one; min and median of messages per second over the rounds.
Printed: each figure and the CURVE/plain ratio.

``python -m benchmarks.curve_cost [--repeat 15] [--prompt-tokens 1024]``
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass

import zmq

from transfer.cluster_key import ClusterKey
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import GenerateRequest, StatsRequest, encode, ids_frame
from transfer.wire.sampling_params import SamplingParams

STOP = b"stop"


def messages(prompt_tokens: int) -> dict[str, list[bytes]]:
    """The measured messages as they go on the wire (frames)."""
    params = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.95)
    gen = encode(
        GenerateRequest(
            rid="cmpl-0123456789abcdef", params=params, room=(3 << 40) | 12345, prefill_addr="tcp://10.0.0.12:29500"
        ),
        ids_frame(list(range(prompt_tokens))),
    )
    return {"GenerateRequest": gen, "heartbeat (StatsRequest)": encode(StatsRequest(nonce=7))}


def _echo(sock: zmq.Socket) -> None:
    """Server loop: echo every message; ``[STOP]`` ends it. A burst's last message is acked."""
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, body = frames[0], frames[1:]
        if len(body) == 1 and body[0].bytes == STOP:
            return
        if len(body) == 1 and body[0].bytes == b"ack?":
            sock.send_multipart([ident, b"ack"])
        elif len(body) > 0 and body[0].bytes[:1] != b"\xff":
            sock.send_multipart([ident, *body], copy=False)


@dataclass
class Pair:
    """One DEALER -> ROUTER pair on its own context, plain or CURVE."""

    label: str
    ctx: zmq.Context
    client: zmq.Socket
    thread: threading.Thread
    guard: object | None

    @classmethod
    def open(cls, label: str, key: ClusterKey | None) -> Pair:
        auth = ControlAuth(key)
        server_ctx = zmq.Context()
        server = server_ctx.socket(zmq.ROUTER)
        server.linger = 0
        guard = auth.server(server, f"bench {label}")
        port = server.bind_to_random_port("tcp://127.0.0.1")
        thread = threading.Thread(
            target=lambda: (_echo(server), server.close(), guard.close(), server_ctx.term()), daemon=True
        )
        thread.start()
        ctx = zmq.Context()
        client = ctx.socket(zmq.DEALER)
        client.linger = 0
        auth.client(client, f"bench {label}")
        client.connect(f"tcp://127.0.0.1:{port}")
        pair = cls(label, ctx, client, thread, guard)
        pair.rtt_us([b"warm"], 50)
        return pair

    def rtt_us(self, frames: list[bytes], n: int) -> float:
        """Mean microseconds per echo over ``n`` sequential echoes."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.client.send_multipart(frames, copy=False)
            self.client.recv_multipart(copy=False)
        return (time.perf_counter() - t0) / n * 1e6

    def burst_per_s(self, frames: list[bytes], n: int) -> float:
        """Messages per second: ``n`` one-way messages (marked not to be echoed), then an ack."""
        quiet = [b"\xff" + bytes(frames[0]), *frames[1:]]
        t0 = time.perf_counter()
        for _ in range(n):
            self.client.send_multipart(quiet, copy=False)
        self.client.send_multipart([b"ack?"])
        self.client.recv_multipart()
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.client.send_multipart([STOP])
        self.thread.join(10)
        self.client.close()
        self.ctx.term()


def measure(repeat: int, rtt_batch: int, burst: int, prompt_tokens: int) -> list[dict]:
    """Rows of {message, bytes, metric, plain, curve} (min and median each), interleaved rounds."""
    pairs = {"plain": Pair.open("plain", None), "curve": Pair.open("curve", ClusterKey.generate())}
    rows = []
    try:
        for name, frames in messages(prompt_tokens).items():
            rtt: dict[str, list[float]] = {k: [] for k in pairs}
            rate: dict[str, list[float]] = {k: [] for k in pairs}
            for _ in range(repeat):
                for k, p in pairs.items():
                    rtt[k].append(p.rtt_us(frames, rtt_batch))
                    rate[k].append(p.burst_per_s(frames, burst))
            size = sum(len(f) for f in frames)
            rows.append(
                {
                    "message": name,
                    "bytes": size,
                    "metric": "round trip (us)",
                    **{k: (min(v), statistics.median(v)) for k, v in rtt.items()},
                }
            )
            rows.append(
                {
                    "message": name,
                    "bytes": size,
                    "metric": "one-way (msg/s)",
                    **{k: (max(v), statistics.median(v)) for k, v in rate.items()},
                }
            )
    finally:
        for p in pairs.values():
            p.close()
    return rows


def report(rows: list[dict]) -> str:
    """The table: best and median of each configuration and the CURVE/plain ratio of both."""
    lines = [
        f"{'message':26} {'bytes':>6} {'metric':16} {'plain best/median':>20} {'CURVE best/median':>20} "
        f"{'ratio best/median':>18}"
    ]
    for r in rows:
        (pb, pm), (cb, cm) = r["plain"], r["curve"]
        lines.append(
            f"{r['message']:26} {r['bytes']:>6} {r['metric']:16} {pb:>9.1f} /{pm:>9.1f} "
            f"{cb:>9.1f} /{cm:>9.1f} {cb / pb:>8.2f} /{cm / pm:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.curve_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15, help="interleaved rounds per message (default 15)")
    p.add_argument("--rtt-batch", type=int, default=200, help="sequential echoes per round (default 200)")
    p.add_argument("--burst", type=int, default=2000, help="one-way messages per round (default 2000)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="GenerateRequest prompt length (default 1024)")
    a = p.parse_args(argv)
    if min(a.repeat, a.rtt_batch, a.burst, a.prompt_tokens) < 1:
        p.error("--repeat, --rtt-batch, --burst and --prompt-tokens must be at least 1")
    print(report(measure(a.repeat, a.rtt_batch, a.burst, a.prompt_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
