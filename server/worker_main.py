"""Worker process entry point: ``python -m server.worker_main --role colocated|prefill|decode ...``.

The launcher passes the whole validated config as JSON (``--config-json``) so every process sees
the same settings; the worker binds its control socket at ``--control-addr``.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from configs.schema import PdserveConfig
from server.worker_loop import WorkerLoop


def load_runner(cfg: PdserveConfig):
    """(runner, model path) with the configured model loaded and the KV pool allocated."""
    from engine.loader import load_model_weights
    from engine.model_paths import resolve_model_path
    from engine.model_runner import ModelRunner

    torch.manual_seed(cfg.engine.seed)
    path = resolve_model_path(cfg.engine.model)
    model_config, weights = load_model_weights(path)
    return ModelRunner(cfg.engine, model_config, weights), path


def make_transport(kind: str, name: str, cluster=None):
    """The KV data plane named by ``cluster.transfer_backend``."""
    from transfer.kv_transport import create_transport

    return create_transport(kind, name, cluster)


def build_colocated(cfg: PdserveConfig, runner, loop: WorkerLoop, worker_id: str, model_name: str):
    from engine.scheduler.colocated import ColocatedScheduler

    return ColocatedScheduler(runner, cfg.scheduler, tuple(runner.model_config.eos_token_ids))


def build_prefill(cfg: PdserveConfig, runner, loop: WorkerLoop, worker_id: str, model_name: str):
    from prefill_worker.kv_sender import KVSender
    from prefill_worker.scheduler import PrefillScheduler

    transport = make_transport(cfg.cluster.transfer_backend, worker_id, cfg.cluster)
    transport.register_pool(runner.pool.buffer, runner.pool.page_bytes)
    sender = KVSender(transport, runner.pool.page_bytes, loop.send)
    return PrefillScheduler(runner, cfg, sender, loop.send, model_name, worker_id)


def build_decode(cfg: PdserveConfig, runner, loop: WorkerLoop, worker_id: str, model_name: str):
    from cache.host_pool import HostKVPool
    from decode_worker.peers import PrefillPeers, make_handshake
    from decode_worker.scheduler import DecodeScheduler

    transport = make_transport(cfg.cluster.transfer_backend, worker_id, cfg.cluster)
    transport.register_pool(runner.pool.buffer, runner.pool.page_bytes)
    hs = make_handshake(worker_id, model_name, runner.pool.layout_descriptor(), transport)
    peers = PrefillPeers(hs, cfg.server.health_interval_s, cfg.cluster.peer_timeout_s)
    host = None
    if cfg.cluster.host_kv_pool_gb > 0:
        host = HostKVPool.for_device_pool(runner.pool.buffer, int(cfg.cluster.host_kv_pool_gb * 2**30))
    eos = tuple(runner.model_config.eos_token_ids)
    return DecodeScheduler(runner, cfg, transport, peers, host, eos, worker_id)


BUILDERS = {"colocated": build_colocated, "prefill": build_prefill, "decode": build_decode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-worker")
    p.add_argument("--role", choices=sorted(BUILDERS), required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--control-addr", required=True, help="ZMQ address to bind, e.g. tcp://127.0.0.1:29500")
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    cfg = PdserveConfig.model_validate_json(args.config_json)
    logging.basicConfig(level=cfg.server.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{args.worker_id}] %(name)s: %(message)s")
    runner, path = load_runner(cfg)
    name = cfg.server.served_model_name or path.stem
    loop = WorkerLoop(args.control_addr, args.worker_id, args.role, name)
    scheduler = BUILDERS[args.role](cfg, runner, loop, args.worker_id, name)
    loop.run(scheduler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
