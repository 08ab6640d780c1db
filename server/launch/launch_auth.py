"""The control-plane key of one ``pdserve launch`` / ``pdserve router`` process and its workers.

A launch that runs the router and all its workers (``own_workers``) and was given no key makes an
ephemeral one (as it makes its cluster id) and hands it to its worker children in their
environment (``PDSERVE_CLUSTER_SECRET_KEY``), never on a command line: ``/proc/PID/environ`` is
readable only by the launch's own user, so another local user cannot drive a worker. Any other
launch or router needs ``--cluster-key FILE`` (the same file on every host) or
``--insecure-control-plane``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from configs.schema import PdserveConfig
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ENV_SECRET, ControlAuth, resolve_auth

log = logging.getLogger("pdserve.launch")


def launch_auth(
    cfg: PdserveConfig, own_workers: bool, environ: Mapping[str, str] | None = None
) -> tuple[ControlAuth, dict[str, str]]:
    """(this process's ``ControlAuth``, variables to add to its worker children's environment).
    Raises ``ControlAuthError`` (saying what to pass) when a key is needed and none is given."""
    environ = os.environ if environ is None else environ
    c = cfg.cluster
    if own_workers and not c.cluster_key and ENV_SECRET not in environ and not c.insecure_control_plane:
        key = ClusterKey.generate()
        log.info("control plane: ephemeral cluster key %s for this launch's router and workers", key.fingerprint)
        return ControlAuth(key), {ENV_SECRET: key.secret.decode()}
    auth = resolve_auth(c.cluster_key, c.insecure_control_plane, environ)
    if not auth.secure:
        log.warning(
            "control plane NOT authenticated (--insecure-control-plane): anyone who reaches a worker's "
            "port can drive it; use --cluster-key FILE"
        )
    return auth, {}
