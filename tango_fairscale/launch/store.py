"""The rendezvous store of one host, served from Tango's main process, and the store helpers the hosts use."""

import logging
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist
from tango.common.exceptions import ConfigurationError

logger = logging.getLogger(__name__)


#: The address Tango's workers rendezvous at (``TrainConfig.distributed_address``).
LOCAL_ADDRESS = "127.0.0.1"

#: Makes every rank of PyTorch's ``tcp://`` rendezvous a client of an existing store.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def free_port(address: str = LOCAL_ADDRESS) -> int:
    """A port the OS reports free on ``address`` (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _check_port_number(port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigurationError(f"distributed_port: must be a TCP port number (1-65535), got {port!r}.")


def _listen(port: int, timeout: timedelta) -> Optional[dist.TCPStore]:
    """A store server on ``LOCAL_ADDRESS:port``, or ``None`` when the port is taken."""
    try:
        return dist.TCPStore(LOCAL_ADDRESS, port, is_master=True, wait_for_workers=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        if "address already in use" in str(error).lower() or "EADDRINUSE" in str(error):
            return None
        raise


@contextmanager
def rendezvous_store(
    port: int,
    *,
    set_in_config: bool,
    timeout: timedelta = timedelta(minutes=5),
    address: str = LOCAL_ADDRESS,
) -> Iterator[int]:
    """
    Serve the process group's rendezvous store from Tango's main process, for the duration of
    the step, and yield its port; the spawned workers connect to it as clients.

    Binding is the test of whether a port is free, so two runs started at the same moment cannot
    both take one. Tango's default port is kept when free and otherwise replaced by one the OS
    picks; a port the config set is kept, and refused when taken, since the user may rely on it.

    The workers reach the store as they would a launcher's agent store: PyTorch's ``tcp://``
    rendezvous makes every rank a client when ``TORCHELASTIC_USE_AGENT_STORE`` is ``True``, which
    is set for the spawned workers only (they inherit the environment at spawn). torch 2.14 and
    later honour it only for the endpoint ``MASTER_ADDR:MASTER_PORT`` names (elsewhere rank 0
    serves a store of its own, and its bind fails with EADDRINUSE on the port this one holds), so
    both are set to ``address`` (the workers' ``distributed_address``) and the store's port, on
    every release.
    """
    _check_port_number(port)
    store = _listen(port, timeout)
    if store is None:
        if set_in_config:
            raise ConfigurationError(
                f"distributed_port: port {port} on {LOCAL_ADDRESS} is already in use (another training "
                "run on this machine?). Choose another port, or remove distributed_port from the step "
                "to have a free one picked."
            )
        store = _listen(0, timeout)
        assert store is not None
        logger.warning(
            "Port %d (torch::train's default distributed_port) is in use, probably by another run on "
            "this machine; the workers of this step rendezvous at port %d instead.",
            port,
            store.port,
        )
    updates = {AGENT_STORE_VARIABLE: str(True), "MASTER_ADDR": address, "MASTER_PORT": str(store.port)}
    previous = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield int(store.port)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        del store


def _store(address: str, port: int, timeout: float, *, server: bool = False) -> dist.TCPStore:
    return dist.TCPStore(
        address, port, is_master=server, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def _reachable(address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something listens at ``address:port``; a TCPStore client would retry noisily instead."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _get(store: dist.Store, key: str, deadline: float) -> str:
    store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
    return store.get(key).decode()
