"""Start-up measurements remembered per machine, so a restarted or relaunched worker does not time again.

A worker times things at start-up whose answer is a property of the machine and the model, not of
the moment: whether its step matmuls gain from every core (core lending's verdict) costs seconds of
every core at every start, and a worker the launcher restarts after a fault (or the next launch of the
same model) would measure the same thing again. ``ProbeMemo`` keeps each answer in one JSON file under
a key naming everything it depends on (``machine()``: the CPU model and its flags, the cores this
process may use, torch's version and CPU capability, pdserve's version; the caller adds the probe's
own inputs, e.g. a model's matmul shapes and dtype) and hands it back for ``TTL_S`` (a day), after
which it is measured again.

Only a quiet measurement is worth keeping: ``QuietWindow`` tells whether anything but this process
used the host's cores it timed on (other processes' CPU time over the window from ``/proc/stat``, less
this process's own, beyond the host's cores the probe left unused); a probe another job competed with
is used for this start and not stored.

Contract: ``get(key)`` returns the value ``put(key, value)`` stored, or None (never stored, stored
more than ``TTL_S`` ago, the file unreadable or off). ``put`` replaces the file atomically under an
exclusive lock (concurrent workers of one launch never lose each other's entries or read a torn file);
a failed write is logged and ignored: the memo only saves time, never decides anything by itself.

The file is ``$PDSERVE_PROBE_MEMO`` (default ``~/.cache/pdserve/probes.json``); ``off`` measures at every
start.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "PDSERVE_PROBE_MEMO"
TTL_S = 86_400.0
FORMAT = 1


def digest(value: object) -> str:
    """A short stable hash of a JSON-able ``value`` (sorted keys)."""
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=12).hexdigest()


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, object]:
    """What every probe's answer depends on beyond its own inputs: this machine and this build."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        version = "source"
    return {
        "cpu": _cpuinfo("model name"),
        "flags": digest(sorted(_cpuinfo("flags").split())),
        "cores": len(os.sched_getaffinity(0)),
        "host_cores": os.cpu_count(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "pdserve": version,
    }


def _cpuinfo(field: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


@dataclass(frozen=True)
class Remembered:
    """A stored answer and when it was measured (epoch seconds)."""

    value: dict
    at: float

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.at


class ProbeMemo:
    """The memo file at ``path``, or a memo that remembers nothing (``path`` None)."""

    def __init__(self, path: Path | None, ttl_s: float = TTL_S) -> None:
        self.path, self.ttl_s = path, ttl_s

    @classmethod
    def from_env(cls) -> ProbeMemo:
        """``$PDSERVE_PROBE_MEMO`` (a file path, or ``off``), default ``~/.cache/pdserve/probes.json``."""
        value = os.environ.get(ENV, "").strip()
        if value.lower() == "off":
            return cls(None)
        return cls(Path(value).expanduser() if value else Path.home() / ".cache" / "pdserve" / "probes.json")

    def get(self, key: dict, now: float | None = None) -> Remembered | None:
        """The answer stored under ``key`` (with ``machine()``) within ``ttl_s``, else None."""
        entry = self._entries().get(digest({**machine(), **key}))
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), dict):
            return None
        found = Remembered(entry["value"], float(entry.get("at", 0.0)))
        return found if 0.0 <= found.age_s(now) <= self.ttl_s else None

    def put(self, key: dict, value: dict, now: float | None = None) -> None:
        """Store ``value`` under ``key`` (with ``machine()``), dropping entries past ``ttl_s``."""
        if self.path is None:
            return
        now = time.time() if now is None else now
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                entries = {
                    k: e
                    for k, e in self._entries().items()
                    if isinstance(e, dict) and 0.0 <= now - float(e.get("at", 0.0)) <= self.ttl_s
                }
                entries[digest({**machine(), **key})] = {"key": key, "value": value, "at": now}
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, sort_keys=True))
                os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not remember a start-up measurement in %s: %s", self.path, e)

    def _entries(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# other processes may use this share of one core while a probe runs and it still counts as quiet: a
# launch's other processes finishing their start-up beside it (measured 0.15-0.17 of a core on an idle
# 2-core host) are; a job computing beside it (0.5 of a core and more) is not
QUIET_SHARE = 0.3


class QuietWindow:
    """Whether the host's cores ran anything but this process between its start and ``quiet()``."""

    def __init__(self) -> None:
        self._host, self._own, self._t0 = _host_busy_s(), _own_cpu_s(), time.monotonic()

    def others_cpu_s(self) -> float | None:
        """CPU seconds other processes used since the start (None where ``/proc/stat`` is unreadable)."""
        host = _host_busy_s()
        if host is None or self._host is None:
            return None
        return (host - self._host) - (_own_cpu_s() - self._own)

    def quiet(self, spare_cores: int = 0) -> bool:
        """Others used at most ``QUIET_SHARE`` of one core over the window, beyond ``spare_cores``
        (host cores the measurement did not use, where others' work does not compete with it);
        False if unknown."""
        others = self.others_cpu_s()
        return others is not None and others <= (QUIET_SHARE + spare_cores) * (time.monotonic() - self._t0)


def _host_busy_s() -> float | None:
    """Busy CPU seconds of every core since boot (``/proc/stat``: all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # guest time is inside user
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
