"""The rendezvous store served from Tango's main process, and two runs on one machine at once."""

import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from tango.common.exceptions import ConfigurationError

from tango_fairscale.launch import AGENT_STORE_VARIABLE, LOCAL_ADDRESS, rendezvous_store
from tests.helpers import TANGO, load_weights, max_abs_difference, tango_env, train_config


def test_store_serves_on_a_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AGENT_STORE_VARIABLE, raising=False)
    with socket.socket() as probe:
        probe.bind((LOCAL_ADDRESS, 0))
        port = probe.getsockname()[1]
    with rendezvous_store(port, set_in_config=True) as served:
        assert served == port
        import os

        assert os.environ[AGENT_STORE_VARIABLE] == "True"
        client = dist.TCPStore(LOCAL_ADDRESS, served, is_master=False)
        client.set("key", "value")
        assert client.get("key") == b"value"
    assert AGENT_STORE_VARIABLE not in __import__("os").environ


def test_taken_default_port_is_replaced_and_taken_configured_port_refused() -> None:
    with socket.socket() as holder:
        holder.bind((LOCAL_ADDRESS, 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with rendezvous_store(taken, set_in_config=False) as served:
            assert served != taken
            dist.TCPStore(LOCAL_ADDRESS, served, is_master=False).set("k", "v")
        with pytest.raises(ConfigurationError, match=rf"distributed_port: port {taken} .* already in use"):
            with rendezvous_store(taken, set_in_config=True):
                pass


@pytest.mark.parametrize("bad", [0, 70000, "54761", True])
def test_bad_port_is_named(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="distributed_port: must be a TCP port number"):
        with rendezvous_store(bad, set_in_config=True):  # type: ignore[arg-type]
            pass


@pytest.mark.slow
def test_two_runs_with_the_default_port_at_once(tmp_path: Path) -> None:
    """Both configs leave distributed_port at Tango's default; both runs start together and finish."""
    import json

    processes = []
    for name in ("a", "b"):
        cwd = tmp_path / name
        cwd.mkdir()
        config = train_config(
            engine="fairscale", wrap="nested", train_steps=6, checkpoint_every=6, callbacks=[]
        )
        (cwd / "config.json").write_text(json.dumps(config))
        command = [TANGO, "run", "config.json", "-w", str(cwd / "ws")]
        for include in ("tango_fairscale", "examples.toy.components", "tests.components"):
            command += ["-i", include]
        processes.append(
            subprocess.Popen(
                command, cwd=cwd, env=tango_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    deadline = time.monotonic() + 300
    outputs = [process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for process in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output.decode()[-4000:]
    # The same config and seed: both trained the same model.
    assert max_abs_difference(load_weights(tmp_path / "a" / "ws"), load_weights(tmp_path / "b" / "ws")) == 0.0
