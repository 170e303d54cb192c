"""
How the workers of a ``torch::train`` step find each other, on one host or on several.

**One host.** Tango's step starts its workers' process group at ``127.0.0.1:distributed_port``
(default 54761). Two runs on one machine with the default would collide with ``EADDRINUSE`` in
every worker. :func:`rendezvous_store` runs in the main process, before the workers are
spawned, and serves the rendezvous store itself.

**Several hosts.** Each host runs one ``tango run`` under a launcher (``torchrun
--nproc-per-node=1`` or ``srun --ntasks-per-node=1``), and each of those spawns
``device_count`` workers, so the world has ``hosts x device_count`` workers and the global rank
of a worker is ``node_rank x device_count + local_rank``. What this package decides:

- :func:`detect_launch` reads the launcher's environment (pure; tested with dicts). Without a
  launcher, or with a launch of one host, it returns ``None`` and nothing changes.
- :func:`host_rendezvous` runs in every host's ``tango`` process before its workers start. Host
  0's serves a fresh store for the step, on a free port, and publishes it in the launch store
  (:mod:`.presence`), which host 0's ``tango`` serves for the whole run: on a port of its own
  under torchrun (whose agent already listens on ``MASTER_PORT``), published through the agent's
  store under a generation number, and at ``MASTER_ADDR:MASTER_PORT`` under SLURM. Fresh stores
  per process and per step mean no key of an earlier attempt (``torchrun --max-restarts``) or
  step can be read by a new one. The hosts register there, check that they agree (same step,
  same ``device_count``, each its own work directory), and learn which other hosts' work
  directories they can read (a shared filesystem): the :class:`HostWorld` every worker of the
  host then gets.
- :class:`LaunchPresence` (:mod:`.presence`): each host's ``tango run`` process, from the
  package's import to its exit, present in a store host 0 serves for the whole run, which
  each training step's rendezvous goes through: a host whose run ended before the step (an
  earlier step failed there) or that disappeared is named at once, not after the rendezvous
  timeout.
- :class:`HostMonitor`: heartbeats between the hosts' ``tango`` processes through that store,
  so that a host that disappears is named, and the workers of the others are stopped within
  seconds even when no collective notices (a host that loses power sends no FIN).
- :func:`worker_train_config` and :func:`worker_environment`: what a spawned worker's
  ``TrainConfig`` and environment become (global rank and world size, devices indexed per
  host, ``is_local_main_process`` true for each host's first worker).
- :func:`stop_run_on_signals` and :func:`stop_workers_on_signals`: SIGINT or SIGTERM to a
  ``tango run`` process ends it with one line, stopping its workers.

By concern: :mod:`.store` (one host's store), :mod:`.launchers` (torchrun and SLURM),
:mod:`.network` (the interface gloo uses), :mod:`.presence` (each host's run, from start to
exit), :mod:`.world` (the hosts of one attempt, a worker's
``TrainConfig``), :mod:`.rendezvous` and :mod:`.failures` (the hosts meet, and name the host that
failed), :mod:`.monitor` (heartbeats), :mod:`.signals` (stopping the workers).
"""

from .failures import HostFailedError, HostLostError
from .launchers import (
    DEFAULT_HOST_TIMEOUT,
    DEFAULT_RENDEZVOUS_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HOST_TIMEOUT_VARIABLE,
    MULTIHOST_VARIABLE,
    RENDEZVOUS_TIMEOUT_VARIABLE,
    SHARED_CHECKPOINTS_VARIABLE,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    WORLD_VARIABLE,
    Launch,
    detect_launch,
    expand_nodelist,
)
from .monitor import HostMonitor
from .network import (
    interface_addresses,
    interface_with_address,
    local_address_towards,
    socket_interface_environment,
)
from .presence import LaunchPresence, close_presences, in_tango_run, launch_presence, start_in_tango_run
from .rendezvous import HostSession, check_hosts, host_rendezvous
from .signals import (
    die_with_parent,
    environment,
    stop_run_on_signals,
    stop_workers_on_signals,
    terminate_workers,
)
from .store import AGENT_STORE_VARIABLE, LOCAL_ADDRESS, free_port, rendezvous_store
from .world import (
    HostInfo,
    HostTrainConfig,
    HostWorld,
    seconds_from_environment,
    worker_environment,
    worker_train_config,
)

__all__ = [
    "AGENT_STORE_VARIABLE",
    "DEFAULT_HOST_TIMEOUT",
    "DEFAULT_RENDEZVOUS_TIMEOUT",
    "HEARTBEAT_INTERVAL",
    "HOST_TIMEOUT_VARIABLE",
    "HostFailedError",
    "HostInfo",
    "HostLostError",
    "HostMonitor",
    "HostSession",
    "HostTrainConfig",
    "HostWorld",
    "LOCAL_ADDRESS",
    "Launch",
    "LaunchPresence",
    "MULTIHOST_VARIABLE",
    "RENDEZVOUS_TIMEOUT_VARIABLE",
    "SHARED_CHECKPOINTS_VARIABLE",
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
    "WORLD_VARIABLE",
    "check_hosts",
    "close_presences",
    "detect_launch",
    "die_with_parent",
    "environment",
    "expand_nodelist",
    "free_port",
    "host_rendezvous",
    "interface_addresses",
    "interface_with_address",
    "launch_presence",
    "local_address_towards",
    "rendezvous_store",
    "seconds_from_environment",
    "socket_interface_environment",
    "in_tango_run",
    "start_in_tango_run",
    "stop_run_on_signals",
    "stop_workers_on_signals",
    "terminate_workers",
    "worker_environment",
    "worker_train_config",
]
