"""The one pdserve config schema: file presets (YAML/TOML) < env ``PDSERVE_*`` < CLI flags.

Sections: ``engine`` (model, KV pool), ``scheduler`` (batching, retract), ``server`` (router/HTTP),
``cluster`` (mode and worker counts). Unknown keys anywhere are refused by name.
Env: ``PDSERVE_<FIELD>`` for any field of any section (field names are unique across sections),
e.g. ``PDSERVE_KV_POOL_TOKENS=8192``, ``PDSERVE_API_KEY=secret``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import tomllib
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from configs.server import ServerConfig


def migrate_bound(text: str) -> tuple[int | None, float | None]:
    """``--migrate-after``: ``"N"`` -> (N steps, None), ``"Ns"`` -> (None, N seconds); ``ValueError``
    with the accepted forms otherwise."""
    t = text.strip()
    try:
        value = float(t[:-1]) if t.endswith("s") else int(t)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"migrate_after {text!r}: give decode steps (e.g. 20) or seconds (e.g. 2.5s), >= 0")
    return (None, float(value)) if t.endswith("s") else (int(value), None)


def worker_pool_tokens(text: str) -> dict[str, int]:
    """``--worker-kv-pool-tokens``: ``"decode-1=4096,..."`` -> {worker id: tokens}; ``ValueError``
    naming the entry that is not ``ID=TOKENS`` with TOKENS >= 1."""
    out: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        wid, sep, tokens = entry.partition("=")
        if not sep or not wid.strip() or not tokens.strip().isdigit() or int(tokens) < 1:
            raise ValueError(f"worker_kv_pool_tokens: {entry!r} should be ID=TOKENS (e.g. decode-1=4096)")
        out[wid.strip()] = int(tokens)
    return out


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["colocated", "pd"] = Field(
        "pd", description="pd (prefill + decode workers) or colocated (workers that do both, --replicas)"
    )
    prefill: int = Field(1, ge=1, description="number of prefill workers (pd mode)")
    decode: int = Field(1, ge=1, description="number of decode workers (pd mode)")
    replicas: int = Field(
        1,
        ge=1,
        description="number of colocated workers (colocated mode): data-parallel "
        "replicas behind one router, balanced by their reported load",
    )
    routing: Literal["least-loaded", "cache-aware"] = Field(
        "cache-aware",
        description="router: how a request picks its workers: cache-aware (the pair whose radix caches "
        "hold most of the prompt, from the workers' KV event feeds, weighed against load: "
        "docs/design/routing.md; with nothing cached it is least-loaded), or "
        "least-loaded (fewest requests held, blind to the caches)",
    )
    routing_balance_slack: int = Field(
        4,
        ge=0,
        description="cache-aware routing: a worker holding more than this many requests above the least "
        "loaded worker of its role gets none of the cache-driven picks (a hot prefix spills)",
    )
    base_port: int = Field(29500, ge=1024, le=65000, description="first port of the workers' control sockets")
    transfer_backend: Literal["nixl", "ucxx", "loopback"] = Field(
        "nixl",
        description="KV data plane: nixl (UCX one-sided writes) or ucxx (UCX tagged messages, needs "
        "pdserve[ucxx]) between processes; loopback only inside one process (tests)",
    )
    ucxx_error_handling: bool = Field(
        False,
        description="ucxx backend: UCX endpoint error handling. Off: shared memory/cma, a dead decode "
        "worker is detected by the write deadline (peer_timeout_s); on: UCX reports it at "
        "once but falls back to TCP, about 10x slower",
    )
    ucxx_copy_lanes: int = Field(
        2,
        ge=0,
        le=64,
        description="ucxx backend, decode side: UCX workers, each with its own thread, that pull "
        "the pages of a large KV write (8 MiB or more: a long prompt's KV from a prefill worker, "
        "a migration from a peer) into the pool in parallel (the target of a ucxx write "
        "does the copy; on one host one CMA stream per worker); 0 = the worker loop's "
        "own UCX worker copies every page",
    )
    bootstrap_timeout_s: float = Field(
        300.0,
        gt=0,
        description="prefill side: drop computed KV that no decode worker asked for after this "
        "(a busy decode worker admits late; the held pages throttle prefill meanwhile)",
    )
    peer_timeout_s: float = Field(
        8.0,
        gt=0,
        description="liveness: a peer worker that answers no heartbeat for this long is dead (heartbeats "
        "are sent and answered on threads that never wait on compute)",
    )
    progress_timeout_s: float = Field(
        120.0,
        gt=0,
        description="progress: a peer worker that answers heartbeats but whose scheduler finished no "
        "loop iteration for this long is stuck and treated as failed; must exceed "
        "peer_timeout_s (a long step on a busy machine is not a failure)",
    )
    transfer_fence_s: float = Field(
        60.0,
        gt=0,
        description="decode side: pages of a transfer whose prefill worker went silent are held this "
        "long (a late write may still land) unless it reappears as a new process",
    )
    host_kv_pool_gb: float = Field(1.0, ge=0, description="decode side: pinned host pool for retracted KV (0 = off)")
    migrate_after: str | None = Field(
        None,
        description="decode side: a retracted request that could not resume locally after this many decode "
        "steps (N) or seconds (Ns, e.g. 2.5s) is offered, through the router, to a peer decode "
        "worker with room; its host KV is written there and its stream moves (off by default)",
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description="decode side (selective disaggregation): a request whose prompt, minus what this "
        "decode worker's radix cache holds, is at most this many tokens is prefilled by the "
        "decode worker itself (chunks within its decode steps) instead of a prefill worker, "
        "when its KV headroom allows and it has not retracted lately "
        "(docs/design/selective-pd.md); 0 = off (the default)",
    )
    local_prefill_backlog_ratio: float = Field(
        1.0,
        ge=0,
        description="decode side (selective disaggregation): a request above local_prefill_max_tokens is "
        "still prefilled here when the prompt tokens this decode worker waits for from prefill "
        "workers are at least this many times its own local prefill backlog plus the request's "
        "uncached prompt counted once per running decode row it would stall (1 + rows times): "
        "a worker with a small batch takes long prompts off prefill workers that are the queue, "
        "one decoding a full batch leaves them there; 0 = off",
    )
    migrate_on_retract: bool = Field(
        False,
        description="decode side (live migration for balance; needs migrate_after): a running request this "
        "worker retracts for lack of pages, its KV just copied to the host pool, is offered to a "
        "peer decode worker with room at once instead of after migrate_after; an offer no peer "
        "takes waits migrate_after before the next one (off by default)",
    )
    migrate_queued: bool = Field(
        False,
        description="decode side (needs migrate_after): a request waiting here for pages, not prefilled yet, "
        "for migrate_after is offered too; the router sends it with its prefill worker to a peer "
        "decode worker with room instead (a re-route before its prefill: no KV to move). What "
        "spreads a steady skewed load, which waits for admission rather than being retracted "
        "(docs/design/migration.md; off by default)",
    )
    migration_copy_threads: int = Field(
        2,
        ge=0,
        le=16,
        description="decode side, NIXL backend: threads that copy one migration's KV in parallel "
        "chunks (NIXL's UCX thread pool; on one host a single CMA copy stream is the "
        "migration's bottleneck); 0 = the migration sender's own thread copies it all",
    )
    migrate_timeout_s: float = Field(
        10.0,
        gt=0,
        description="decode side: a migration offer no peer took up (no KV destination) within this "
        "long is withdrawn and the request resumes locally",
    )
    fresh_pair_retries: int = Field(
        1,
        ge=0,
        le=8,
        description="router: a request whose prefill or decode worker dies before its first token "
        "is sent again this many times, each time on another pair (workers outside the "
        "failed one when there are, else with the dead worker replaced); 0 = answer 503",
    )
    max_failovers: int = Field(
        2,
        ge=0,
        le=16,
        description="router: a request whose streaming worker dies after tokens were streamed is sent "
        "again on a live route as a continuation (prompt + the tokens so far; the client's stream "
        "goes on from the next token) at most this many times; 0 = end it with a 503",
    )
    discovery: str | None = Field(
        None,
        description="where routers find workers: etcd://HOST:PORT[/prefix] (workers register under a lease, "
        "routers watch) or dns://NAME:PORT[?role=decode] (a router resolves the name every "
        "discovery_interval_s; every A/AAAA record is a worker of that role); several targets "
        "comma-separated (dns://prefill.ns.svc:29500,dns://decode.ns.svc:29500)",
    )
    discovery_lease_s: float = Field(
        10.0,
        ge=2,
        description="etcd discovery: a worker's lease; a worker that dies without leaving is dropped "
        "this long after its last renewal",
    )
    discovery_interval_s: float = Field(
        3.0, gt=0, description="dns discovery: how often a router resolves the names again"
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="worker: after SIGTERM or a router's drain, finish the requests held for at most "
        "this long (then fail the rest with 503), and exit 0",
    )
    restart_workers: bool = Field(
        True,
        description="launcher: start a worker again when its process exits "
        "(not after a drain: a drained worker exits 0 and stays down)",
    )
    restart_limit: int = Field(
        5,
        ge=0,
        description="launcher: give up on a worker (it stays dead, /health says why) after this many "
        "restarts in a row that never got ready",
    )
    restart_backoff_s: float = Field(
        1.0,
        ge=0,
        description="launcher: wait before restarting a worker; doubles with every restart in a row "
        "that never got ready",
    )
    restart_backoff_max_s: float = Field(60.0, ge=0, description="launcher: longest wait before a restart")
    cluster_id: str | None = Field(
        None,
        description="id every worker and router of one deployment share: a worker reporting another id "
        "is never routed to, handshaken or sent KV. Default: a random id per launch that runs "
        "the router and all its workers; set the same value on every host of a split "
        "deployment (--roles, --worker), which is otherwise unchecked",
    )
    cluster_key: str | None = Field(
        None,
        description="file with the cluster's CURVE key pair ('pdserve keygen FILE'): every router, worker "
        "and probe of one deployment needs the same one; control sockets refuse any peer without "
        "it. A launch that runs the router and all its workers makes an ephemeral one itself",
    )
    insecure_control_plane: bool = Field(
        False,
        description="run the control plane without authentication (plain ZMQ: anyone who reaches a "
        "worker's port can drive it); without it a worker with no cluster key refuses to start",
    )
    worker_cpus: str = Field(
        "off",
        description="launcher: cores per worker on this host: off (every worker may "
        "use every core), auto (split the cores among the workers, spare ones to the "
        "router), or ID=CPUS,... (e.g. prefill-0=0,decode-0=1; CPUS like 0-3 or 0+2)",
    )
    node_cpus: float | None = Field(
        None,
        gt=0,
        description="launcher: run each worker of this host as a node of this many cores: its process in "
        "its own CPU-quota cgroup (cgroup v1 cpu controller, as docker run --cpus; removed at shutdown; "
        "refused where cgroups are not writable), one torch thread per whole core, core lending off",
    )
    worker_kv_pool_tokens: str = Field(
        "",
        description="launcher: KV pool capacity in tokens of the named workers instead of kv_pool_tokens: "
        "ID=TOKENS,... (e.g. decode-1=8192: a decode worker on a device with more memory); "
        "pool sizes may differ between the workers that exchange KV",
    )
    core_lending: Literal["off", "prefill", "all"] = Field(
        "all",
        description="launcher: a worker that is the only one of this host's unpinned launch with work "
        "runs its step on every core: all (default: any worker "
        "whose step matmuls measure >= 1.1x faster on every core at start-up borrows; a "
        "decode worker not while a prefill worker computes for it), prefill (decode workers "
        "only lend), or off",
    )
    core_lending_verdict: Literal["measure", "borrow", "lend"] = Field(
        "measure",
        description="launcher: how a worker allowed to borrow decides whether it does: measure (default: "
        "its step matmuls at start-up, >= 1.1x faster on every core; timings this machine measured "
        "quietly for the same model within a day are reused, kept in $PDSERVE_PROBE_MEMO, off to "
        "measure at every start), borrow or lend (pinned, no "
        "measurement: for a host whose start-up load makes the measurement unreliable, and for tests)",
    )
    worker_host: str = Field(
        "127.0.0.1",
        description="launcher: bind address of this host's worker control sockets (0.0.0.0 to serve "
        "a router on another host; their control sockets take only peers holding the "
        "cluster key)",
    )
    advertise_host: str | None = Field(
        None,
        description="launcher: the name or address other hosts reach this host's workers by (default: "
        "worker_host, or this machine's hostname when worker_host is a wildcard)",
    )

    @model_validator(mode="after")
    def _migrate_after_form(self) -> ClusterConfig:
        if self.migrate_after is not None:
            migrate_bound(self.migrate_after)
        elif self.migrate_on_retract:
            raise ValueError(
                "migrate_on_retract needs migrate_after (how long a request no peer took waits before "
                "it is offered again): add --migrate-after, e.g. --migrate-after 20"
            )
        elif self.migrate_queued:
            raise ValueError(
                "migrate_queued needs migrate_after (how long a request waits for pages before it is "
                "offered): add --migrate-after, e.g. --migrate-after 0.5s"
            )
        return self

    def workers(self) -> list[tuple[str, str]]:
        """(role, worker id) of every worker of the deployment, in launch order (which also numbers
        their control ports): ``colocated-i``, or ``prefill-i`` then ``decode-j``."""
        counts = (
            {"colocated": self.replicas}
            if self.mode == "colocated"
            else {"prefill": self.prefill, "decode": self.decode}
        )
        return [(role, f"{role}-{i}") for role, n in counts.items() for i in range(n)]

    @model_validator(mode="after")
    def _pool_tokens_of_known_workers(self) -> ClusterConfig:
        ids = [wid for _, wid in self.workers()]
        if unknown := sorted(set(worker_pool_tokens(self.worker_kv_pool_tokens)) - set(ids)):
            raise ValueError(
                f"worker_kv_pool_tokens names {', '.join(unknown)}, not a worker of this {self.mode} "
                f"deployment ({', '.join(ids)})"
            )
        return self

    @model_validator(mode="after")
    def _progress_after_liveness(self) -> ClusterConfig:
        if self.progress_timeout_s <= self.peer_timeout_s:
            raise ValueError(
                f"progress_timeout_s ({self.progress_timeout_s:g}) must be larger than peer_timeout_s "
                f"({self.peer_timeout_s:g}): raise --progress-timeout-s"
            )
        return self


class PdserveConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = EngineConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _planner_in_pd_mode(self) -> PdserveConfig:
        if self.server.planner != "off" and self.cluster.mode != "pd":
            raise ValueError(f"planner {self.server.planner!r} switches PD workers' roles: it needs --mode pd")
        return self


SECTIONS: dict[str, type[BaseModel]] = {name: f.annotation for name, f in PdserveConfig.model_fields.items()}


def _field_owner() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, model in SECTIONS.items():
        for name in model.model_fields:
            assert name not in owner, f"config field {name!r} appears in two sections"
            owner[name] = section
    return owner


FIELD_SECTION = _field_owner()


def read_file(path: str | Path) -> dict:
    """Parse a YAML or TOML preset into a nested dict (sections at the top level)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    text = p.read_text()
    data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping of sections ({', '.join(SECTIONS)})")
    return data


def env_overrides(environ: dict[str, str] | None = None) -> dict:
    """``PDSERVE_<FIELD>`` variables as a nested dict (values stay strings; pydantic converts)."""
    environ = os.environ if environ is None else environ
    out: dict[str, dict] = {}
    for key, value in environ.items():
        if not key.startswith("PDSERVE_"):
            continue
        name = key.removeprefix("PDSERVE_").lower()
        if name in FIELD_SECTION:
            out.setdefault(FIELD_SECTION[name], {})[name] = value
    return out


def flat_to_nested(flat: dict) -> dict:
    out: dict[str, dict] = {}
    for name, value in flat.items():
        out.setdefault(FIELD_SECTION[name], {})[name] = value
    return out


def merge(*layers: dict) -> dict:
    out: dict[str, dict] = {}
    for layer in layers:
        for section, values in layer.items():
            if section not in SECTIONS:
                raise ValueError(f"unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ValueError(f"config section {section!r} must be a mapping")
            out.setdefault(section, {}).update(values)
    return out


def load_config(
    file: str | Path | None = None, cli: dict | None = None, environ: dict[str, str] | None = None
) -> PdserveConfig:
    """Build the config: file preset, then env, then CLI flags (flat field names)."""
    layers = [read_file(file) if file else {}, env_overrides(environ), flat_to_nested(cli or {})]
    return PdserveConfig.model_validate(merge(*layers))
