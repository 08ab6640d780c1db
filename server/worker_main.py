"""Worker process entry point: ``python -m server.worker_main --role colocated ...``.

The launcher passes the whole validated config as JSON (``--config-json``) so every process sees
the same settings; the worker binds its control socket at ``--control-addr``.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from configs.schema import PdserveConfig


def build_colocated(cfg: PdserveConfig):
    from engine.loader import load_model_weights
    from engine.model_paths import resolve_model_path
    from engine.model_runner import ModelRunner
    from engine.scheduler.colocated import ColocatedScheduler

    torch.manual_seed(cfg.engine.seed)
    path = resolve_model_path(cfg.engine.model)
    model_config, weights = load_model_weights(path)
    runner = ModelRunner(cfg.engine, model_config, weights)
    return ColocatedScheduler(runner, cfg.scheduler, tuple(model_config.eos_token_ids)), path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-worker")
    p.add_argument("--role", choices=["colocated"], required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--control-addr", required=True, help="ZMQ address to bind, e.g. tcp://127.0.0.1:29500")
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    cfg = PdserveConfig.model_validate_json(args.config_json)
    logging.basicConfig(level=cfg.server.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{args.worker_id}] %(name)s: %(message)s")
    from server.worker_loop import WorkerLoop

    scheduler, path = build_colocated(cfg)
    name = cfg.server.served_model_name or path.stem
    WorkerLoop(scheduler, args.control_addr, args.worker_id, args.role, name).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
