"""Starting or joining Ray: multi-node is Ray's job, this only picks which cluster to use.

Order: an explicit ``address`` argument; ``RAY_ADDRESS``; the cluster a ``ray start`` on this
machine recorded; otherwise a new local instance with the dashboard off, every Ray process bound
to loopback (nothing reachable from other machines) and quiet logs.
"""

from __future__ import annotations

import contextlib
import logging
import os

import ray

# Passed to every worker process; users add theirs through runtime_env={"env_vars": {...}}.
DEFAULT_WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",  # fork-after-tokenize warnings and thread oversubscription
}


def _propagated_env() -> dict[str, str]:
    """The driver's sandbox choices (``sandbox.allow_unisolated``), so code run by a worker on any node
    obeys them as code run by the driver does."""
    from rlfoundry.sandbox import ALLOW_UNISOLATED_ENV, ISOLATION_ENV

    return {k: os.environ[k] for k in (ALLOW_UNISOLATED_ENV, ISOLATION_ENV) if k in os.environ}


def _existing_cluster(address: str | None) -> str | None:
    """The address of a cluster to join, or None to start a local one."""
    if address is not None:
        return None if address == "local" else address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    return _ray_start_cluster()


def _ray_start_cluster() -> str | None:
    """The cluster a ``ray start`` on this machine recorded, if it is still running.

    Ray's own ray.init() trusts the recorded address blindly and then waits forever on a cluster
    that has gone; we only use it while a raylet of that cluster is alive. Both helpers are
    private to Ray, so if they move we fall back to starting a local instance.
    """
    try:
        from ray._private.services import find_bootstrap_address, find_gcs_addresses

        recorded = find_bootstrap_address(None)
        return recorded if recorded and recorded in find_gcs_addresses() else None
    except Exception:
        return None


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    runtime_env: dict | None = None,
    namespace: str | None = None,
) -> bool:
    """Connect to Ray or start it. Returns True when this call started a local instance.

    ``num_cpus``/``num_gpus`` only apply to a local instance (an existing cluster has its own).
    ``address="local"`` always starts a new local instance (tests); ``"auto"`` must find one.
    """
    if ray.is_initialized():
        return False
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**DEFAULT_WORKER_ENV, **_propagated_env(), **runtime_env.get("env_vars", {})}
    common = dict(runtime_env=runtime_env, namespace=namespace, logging_level=logging.WARNING, log_to_driver=True)
    cluster = _existing_cluster(address)
    if cluster is not None:
        # ray.init rewrites a loopback host to the routable IP, where a loopback-only cluster
        # (e.g. one that init_ray started in another process) does not listen.
        host = cluster.rsplit(":", 1)[0].removeprefix("ray://")
        with _loopback_node() if host in ("127.0.0.1", "localhost") else contextlib.nullcontext():
            ray.init(address=cluster, **common)
        return False
    with _loopback_node():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            # Ray starts one idle worker per CPU for a new driver, with the job's environment. Every actor we
            # start is a worker-group rank with environment variables of its own (RANK, MASTER_*: base.py),
            # which no such worker has: Ray starts a fresh process for each, and the idle ones only cost
            # start-up CPU and memory (~0.5 s and ~80 MB each here) beside the driver's own start.
            _system_config={"prestart_worker_first_driver": False},
            **common,
        )
    return True


@contextlib.contextmanager
def _loopback_node():
    """Make a local instance bind its servers to 127.0.0.1 instead of every interface.

    ray.init turns ``_node_ip_address="127.0.0.1"`` into the machine's routable IP, and Ray's
    servers then listen on all interfaces. Ray skips that for single-machine use on macOS/Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``); we take the same path while the node starts. The
    constant is private, so if it moves Ray simply keeps its default binding.
    """
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    saved = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved is not None:
            constants.ENABLE_RAY_CLUSTER = saved
