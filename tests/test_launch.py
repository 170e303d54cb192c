"""
The rendezvous store served from Tango's main process, two runs on one machine at once, and
launches across hosts: the launcher's environment, the hosts' rendezvous, the workers' config.
"""

import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.distributed as dist
from tango.common.exceptions import ConfigurationError

from tango_fairscale.launch import AGENT_STORE_VARIABLE, LOCAL_ADDRESS, HostInfo, HostWorld, rendezvous_store
from tests.helpers import TANGO, free_port, load_weights, max_abs_difference, tango_env, train_config


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


def test_workers_rendezvous_as_clients_of_the_served_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    torch's ``tcp://`` rendezvous, as a spawned worker of rank 0 makes it, is a client of the store
    the main process serves: on torch 2.14 and later only where MASTER_ADDR/MASTER_PORT name that
    endpoint (else rank 0 serves a store of its own on the port this one holds: EADDRINUSE).
    """
    import os

    for name in (AGENT_STORE_VARIABLE, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "stale") if name == "MASTER_PORT" else monkeypatch.delenv(
            name, raising=False
        )
    with rendezvous_store(free_port(), set_in_config=False) as served:
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (LOCAL_ADDRESS, str(served))
        url = f"tcp://{LOCAL_ADDRESS}:{served}?rank=0&world_size=2"
        store, rank, world_size = next(dist.rendezvous(url, timeout=timedelta(seconds=10)))
        store.set("from rank 0", "seen")
        assert dist.TCPStore(LOCAL_ADDRESS, served, is_master=False).get("from rank 0") == b"seen"
    assert os.environ["MASTER_PORT"] == "stale" and "MASTER_ADDR" not in os.environ


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


# make test covers the port choice at library level (test_taken_default_port_is_replaced_...).
@pytest.mark.extended
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


# --- Launches across hosts: the launcher's environment ------------------------------------------------

TORCHRUN_STATIC = {
    # What torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --master-addr=10.0.0.1 --master-port=29500
    # gives its worker (the tango process).
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}
SLURM_STEP = {
    # What srun --nodes=4 --ntasks-per-node=1 gives the task on the third node.
    "SLURM_JOB_ID": "123457",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "4",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_JOB_NODELIST": "node[01-03,07]",
    "SLURM_STEP_NODELIST": "node[01-03,07]",
}


def test_no_launcher_and_one_host_change_nothing() -> None:
    from tango_fairscale.launch import detect_launch

    assert detect_launch({}) is None
    assert (
        detect_launch({**TORCHRUN_STATIC, "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "1", "GROUP_RANK": "0"})
        is None
    )
    assert detect_launch({**SLURM_STEP, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}) is None
    # A batch script's environment (no srun step) is not a launch of one tango per host.
    batch = {key: value for key, value in SLURM_STEP.items() if not key.startswith("SLURM_STEP")}
    assert detect_launch(batch) is None
    assert detect_launch({**TORCHRUN_STATIC, "TANGO_FAIRSCALE_MULTIHOST": "0"}) is None


def test_torchrun_static_and_c10d() -> None:
    from tango_fairscale.launch import Launch, detect_launch

    assert detect_launch(TORCHRUN_STATIC) == Launch("torchrun", 1, 2, "10.0.0.1", 29500, agent_store=True)
    # c10d: no node rank given, torchrun assigns GROUP_RANK; the store it shares is at MASTER_*.
    c10d = {**TORCHRUN_STATIC, "TORCHELASTIC_RUN_ID": "job7", "GROUP_RANK": "0", "RANK": "0"}
    assert detect_launch(c10d) == Launch("torchrun", 0, 2, "10.0.0.1", 29500, agent_store=True)
    # RANK when GROUP_RANK is missing (one process per node: the same number).
    without_group = {k: v for k, v in TORCHRUN_STATIC.items() if not k.startswith("GROUP_")}
    assert detect_launch(without_group) == Launch("torchrun", 1, 2, "10.0.0.1", 29500, agent_store=True)
    # With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 nobody serves MASTER_PORT: host 0 serves there itself.
    unshared = {**TORCHRUN_STATIC, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert detect_launch(unshared).agent_store is False  # type: ignore[union-attr]


def test_torchrun_with_several_processes_per_host_is_refused() -> None:
    from tango_fairscale.launch import detect_launch

    with pytest.raises(ConfigurationError, match=r"LOCAL_WORLD_SIZE=2.*--nproc-per-node=1"):
        detect_launch({**TORCHRUN_STATIC, "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigurationError, match=r"GROUP_RANK='x' in the environment is not a whole number"):
        detect_launch({**TORCHRUN_STATIC, "GROUP_RANK": "x"})
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        detect_launch({k: v for k, v in TORCHRUN_STATIC.items() if k != "MASTER_ADDR"})


def test_slurm() -> None:
    from tango_fairscale.launch import SLURM_PORT_BASE, SLURM_PORT_SPAN, Launch, detect_launch

    port = SLURM_PORT_BASE + 123457 % SLURM_PORT_SPAN
    assert detect_launch(SLURM_STEP) == Launch("slurm", 2, 4, "node01", port, agent_store=False)
    explicit = {**SLURM_STEP, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    assert detect_launch(explicit) == Launch("slurm", 2, 4, "10.1.2.3", 29400, agent_store=False)
    with pytest.raises(ConfigurationError, match=r"srun started 8 tasks on 4 node.*--ntasks-per-node=1"):
        detect_launch({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8"})
    with pytest.raises(ConfigurationError, match=r"SLURM_NODEID=4 is not a node rank of a launch of 4 hosts"):
        detect_launch({**SLURM_STEP, "SLURM_NODEID": "4"})


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu5", ["gpu5"]),
        ("a[8-10],b1", ["a8", "a9", "a10", "b1"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("x[001-002],y[3]", ["x001", "x002", "y3"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list) -> None:
    from tango_fairscale.launch import expand_nodelist

    assert expand_nodelist(nodelist) == hosts


def test_a_huge_nodelist_gives_its_first_host_at_once() -> None:
    from tango_fairscale.launch import detect_launch

    # Every name of node[1-100000000] was expanded (minutes, gigabytes) to take the first.
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_JOB_NODELIST": "node[1-100000000]",
    }
    launch = detect_launch(env)
    assert launch is not None and launch.master_addr == "node1"


def test_expand_nodelist_refuses_malformed() -> None:
    from tango_fairscale.launch import expand_nodelist

    with pytest.raises(ConfigurationError, match="unbalanced brackets"):
        expand_nodelist("node[1-2")
    with pytest.raises(ConfigurationError, match="is not N or N-M"):
        expand_nodelist("node[a-b]")


def test_gloo_interface_is_the_one_that_reaches_the_master() -> None:
    from tango_fairscale.launch import (
        interface_addresses,
        local_address_towards,
        socket_interface_environment,
    )

    table = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.7.5"]}
    assert socket_interface_environment({}, "192.168.7.5", table) == {"GLOO_SOCKET_IFNAME": "ib0"}
    # The user's choice stands; an address no interface has sets nothing.
    assert socket_interface_environment({"GLOO_SOCKET_IFNAME": "eth0"}, "192.168.7.5", table) == {}
    assert socket_interface_environment({}, "172.16.0.1", table) == {}
    # On this machine: loopback reaches loopback.
    address = local_address_towards("127.0.0.1", 9)
    assert address == "127.0.0.1"
    assert socket_interface_environment({}, address, interface_addresses()) == {"GLOO_SOCKET_IFNAME": "lo"}


def _world(node_rank: int = 1) -> HostWorld:

    hosts = tuple(
        HostInfo(f"h{n}", f"10.0.0.{n + 1}", f"/ws{n}/work", 2, "step-id", f"t{n}") for n in range(2)
    )
    return HostWorld(node_rank, 2, "10.0.0.1", 4242, "attempt-1", hosts, (True, node_rank == 1))


def test_worker_config_and_environment_across_hosts(tmp_path: Path) -> None:
    from tango.integrations.torch import TrainConfig

    from tango_fairscale.launch import HostWorld, worker_environment, worker_train_config

    world = _world(node_rank=1)
    assert HostWorld.from_json(world.to_json()) == world
    config = TrainConfig("step-id", tmp_path, devices=[-1, -1], is_distributed=True, world_size=2)
    host_config = worker_train_config(config, world)
    assert host_config.world_size == 4
    assert host_config.devices == [-1] * 4
    assert (host_config.distributed_address, host_config.distributed_port) == ("10.0.0.1", 4242)
    leaders = []
    for local_rank in range(2):
        host_config.worker_id = world.global_rank(local_rank)
        leaders.append(host_config.is_local_main_process)
        assert host_config.worker_local_default_device == torch.device("cpu")
    # Global ranks 2 and 3; the host's first worker keeps its work directory.
    assert [world.global_rank(r) for r in range(2)] == [2, 3]
    assert leaders == [True, False]
    # GPUs: devices[global rank] is the local GPU.
    gpu_config = worker_train_config(TrainConfig("s", tmp_path, devices=[0, 1], world_size=2), world)
    assert [gpu_config.devices[world.global_rank(r)] for r in range(2)] == [0, 1]
    environment = worker_environment(world, 1)
    assert (environment["RANK"], environment["LOCAL_RANK"], environment["WORLD_SIZE"]) == ("3", "1", "4")
    assert world.describe(1) == "host 1 (h1, 10.0.0.2; node rank 1, global ranks 2-3)"


def test_hosts_must_agree_on_step_and_device_count() -> None:
    from tango_fairscale.launch import HostInfo, check_hosts

    same = [HostInfo(f"h{n}", "a", f"/w{n}", 2, "s", f"t{n}") for n in range(2)]
    check_hosts(same, 0)
    with pytest.raises(ConfigurationError, match=r"device_count: host 1 \(h1\) has 3 workers, host 0 has 2"):
        check_hosts([same[0], HostInfo("h1", "a", "/w1", 3, "s", "t1")], 0)
    with pytest.raises(
        ConfigurationError, match="runs step other where host 0 runs s: the step's config differs"
    ):
        check_hosts([same[0], HostInfo("h1", "a", "/w1", 2, "other", "t1")], 0)
    # Another version of the package is named before the step id it also changes.
    with pytest.raises(
        ConfigurationError, match="Host 1 \\(h1\\) runs tango-fairscale 0.0.1 where host 0 runs"
    ):
        check_hosts([same[0], HostInfo("h1", "a", "/w1", 2, "other", "t1", version="0.0.1")], 0)
    # Another torch or Python: checkpoints and collectives differ between releases.
    with pytest.raises(ConfigurationError, match=r"Host 1 \(h1\) runs torch 2\.99\.0 where host 0 runs 2\."):
        check_hosts([same[0], HostInfo("h1", "a", "/w1", 2, "s", "t1", torch="2.99.0")], 0)
    with pytest.raises(ConfigurationError, match=r"Host 1 \(h1\) runs Python 3\.99\.1 where host 0 runs 3\."):
        check_hosts([same[0], HostInfo("h1", "a", "/w1", 2, "s", "t1", python="3.99.1")], 0)
    # Other pretrained files at the same path (another seed, a stale copy): both fingerprints named.
    with pytest.raises(
        ConfigurationError, match=r"reads other pretrained files than host 0 .*fingerprints b and a"
    ):
        check_hosts(
            [
                HostInfo("h0", "a", "/w0", 2, "s", "t0", base_files="a"),
                HostInfo("h1", "a", "/w1", 2, "s", "t1", base_files="b"),
            ],
            0,
        )


def test_the_fingerprint_of_pretrained_files_tells_another_seed_and_not_a_copy(
    tiny_pretrained: Any, tmp_path: Path
) -> None:
    import shutil

    from tango_fairscale.finetune.safetensors_files import fingerprint
    from tango_fairscale.preflight import pretrained_fingerprint

    one, other = tiny_pretrained(seed=3), tiny_pretrained(seed=4)
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    assert fingerprint(one) == fingerprint(copy) != fingerprint(other)
    model = {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(copy)}
    wrapped = {"type": "fairscale::with_wrapped_modules", "model": model, "modules_to_wrap": ["x"]}
    from tango.common import Lazy, Params
    from tango.integrations.torch import Model

    # The step's model as the training step gets it: a Lazy of the config.
    assert pretrained_fingerprint(Lazy(Model, Params(wrapped))) == f"{copy.resolve()}={fingerprint(one)}"
    assert pretrained_fingerprint(Lazy(Model, Params({"type": "toy::regressor"}))) == ""


def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (asked every 20 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _serve_store() -> dist.TCPStore:
    from datetime import timedelta

    return dist.TCPStore(
        LOCAL_ADDRESS, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def test_two_hosts_meet_through_the_agent_store(tmp_path: Path) -> None:
    """Both sides of host_rendezvous, as threads: host 0 serves, host 1 finds it through the agent's store."""
    import threading

    from tango_fairscale import launch as launching
    from tango_fairscale.launch import Launch, host_rendezvous

    agent = _serve_store()
    worlds: dict = {}
    errors: list = []

    def host(node: int) -> None:
        launch = Launch("torchrun", node, 2, LOCAL_ADDRESS, agent.port, agent_store=True)
        try:
            with host_rendezvous(
                launch, step_id="step", work_dir=tmp_path / f"ws{node}", device_count=2, timeout=60
            ) as session:
                worlds[node] = session.world
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=host, args=(node,)) for node in (1, 0)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        launching.close_presences()  # what each host's tango does at its exit
    assert not errors, errors
    assert worlds[0].attempt == worlds[1].attempt
    assert (worlds[0].store_address, worlds[0].store_port) == (worlds[1].store_address, worlds[1].store_port)
    assert worlds[0].store_port != agent.port  # the agent's port is the agent's
    assert [info.work_dir for info in worlds[1].hosts] == [
        str((tmp_path / f"ws{n}").resolve()) for n in (0, 1)
    ]
    # The same filesystem: each host reads the other's work directory.
    assert worlds[0].visible == worlds[1].visible == (True, True)


def test_a_restarted_host_skips_the_attempt_it_already_joined() -> None:
    """torchrun restarted host 1's tango: it must wait for host 0's next store, not rejoin the old one."""
    import threading

    from tango_fairscale import launch as launching
    from tango_fairscale.launch import presence as rendezvous

    agent = _serve_store()
    prefix = "tango_fairscale/step"
    old = _serve_store()
    assert rendezvous._claim(old, 1)  # the killed incarnation of host 1 joined attempt 1
    agent.set(f"{prefix}/endpoint", f"1 {LOCAL_ADDRESS} {old.port}")
    new = _serve_store()

    def publish_next() -> None:
        # Once host 1 has tried the old attempt (a second claim of node rank 1 there), as host 0's
        # restart would: published earlier, the new attempt would let it skip the old one untried.
        # Published anyway after 20 s, so that the assertions below say what went wrong.
        _wait_until(lambda: int(old.add("join/1", 0)) >= 2, timeout=20)
        agent.set(f"{prefix}/endpoint", f"2 {LOCAL_ADDRESS} {new.port}")

    publisher = threading.Thread(target=publish_next)
    publisher.start()
    launch = launching.Launch("torchrun", 1, 2, LOCAL_ADDRESS, agent.port, agent_store=True)
    store = rendezvous._join(launch, prefix, timeout=30)
    publisher.join(10)
    assert store.port == new.port
    # It tried the old attempt (and was refused: node rank 1 was taken), then joined the new one.
    assert int(old.add("join/1", 0)) == 2
    assert int(new.add("join/1", 0)) == 1


def test_a_published_store_that_is_gone_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tango_fairscale import launch as launching
    from tango_fairscale.launch import presence as rendezvous

    agent = _serve_store()
    prefix = "tango_fairscale/step"
    dead_port = launching.free_port()
    agent.set(f"{prefix}/endpoint", f"1 {LOCAL_ADDRESS} {dead_port}")
    live = _serve_store()
    # Host 1's probes of the stores it finds published, seen as they happen (and still made).
    probed_dead = threading.Event()
    reachable = rendezvous._reachable

    def probe(address: str, port: int) -> bool:
        answered = reachable(address, port)
        if port == dead_port:
            probed_dead.set()
        return answered

    monkeypatch.setattr(rendezvous, "_reachable", probe)

    def publish_next() -> None:
        # Once host 1 has found the published store gone, not before (bounded, as above).
        probed_dead.wait(20)
        agent.set(f"{prefix}/endpoint", f"2 {LOCAL_ADDRESS} {live.port}")

    publisher = threading.Thread(target=publish_next)
    publisher.start()
    store = rendezvous._join(launching.Launch("torchrun", 1, 2, LOCAL_ADDRESS, agent.port, True), prefix, 30)
    publisher.join(10)
    assert probed_dead.is_set()
    assert store.port == live.port


def _rendezvous_in_a_thread(launch: Any, work_dir: Path) -> Tuple[Any, List[Tuple[float, BaseException]]]:
    """Host ``launch.node_rank`` at step "train"'s rendezvous, in a thread; what it raised, and when."""
    import threading

    from tango_fairscale.launch import host_rendezvous

    raised: List[Tuple[float, BaseException]] = []

    def host() -> None:
        try:
            with host_rendezvous(
                launch, step_id="s", work_dir=work_dir, device_count=2, timeout=120, step_name="train"
            ):
                pass
        except BaseException as error:  # noqa: BLE001 - the test reads it
            raised.append((time.monotonic(), error))

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    return thread, raised


@pytest.mark.parametrize("failing", [1, 0])
def test_a_host_whose_run_ended_before_the_step_is_named_at_the_rendezvous(
    tmp_path: Path, failing: int
) -> None:
    """
    One host's run ends (its data step failed) while the other waits at the training step's
    rendezvous: the waiting one raises at once, naming it (it waited for the 30-minute timeout).
    """
    from tango_fairscale import launch as launching
    from tango_fairscale.launch import HostFailedError, Launch

    agent = _serve_store()
    launches = [Launch("torchrun", node, 2, LOCAL_ADDRESS, agent.port, agent_store=True) for node in (0, 1)]
    waiting = 1 - failing
    try:
        # Not in a `tango run`: nothing starts at the package's import.
        assert launching.start_in_tango_run() is None
        ending = launching.launch_presence(launches[failing], timeout=60)
        thread, raised = _rendezvous_in_a_thread(launches[waiting], tmp_path / "ws")
        assert _wait_until(lambda: ending._connected.is_set(), 30) and ending._error is None
        time.sleep(1.5)  # the other host is waiting now
        ended_at = time.monotonic()
        ending.close('failed: step "data" failed there: ValueError: no data')
        thread.join(30)
    finally:
        launching.close_presences()
    assert raised, "the waiting host did not end"
    ((when, error),) = raised
    print(f"host {waiting} raised {when - ended_at:.2f} s after host {failing}'s run ended: {error}")
    assert isinstance(error, HostFailedError) and when - ended_at < 5
    assert str(error) == (
        f'Step "train" cannot start on host {waiting}: host {failing} ({socket.gethostname()}, 127.0.0.1; '
        f'node rank {failing}) ended its tango run before reaching it, step "data" failed there: '
        "ValueError: no data. Fix that host's error, then run the same command on every host again."
    )


def test_a_host_that_stops_beating_before_the_step_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tango_fairscale import launch as launching
    from tango_fairscale.launch import HostLostError, Launch, presence

    monkeypatch.setattr(presence, "lost_after", lambda host_timeout: 1.5)
    agent = _serve_store()
    launches = [Launch("torchrun", node, 2, LOCAL_ADDRESS, agent.port, agent_store=True) for node in (0, 1)]
    try:
        silent = launching.launch_presence(launches[1], timeout=60)
        thread, raised = _rendezvous_in_a_thread(launches[0], tmp_path / "ws")
        assert _wait_until(silent._connected.is_set, 30)
        time.sleep(1.5)  # host 1 has beaten
        silent._stop.set()  # its tango is frozen or killed: no more heartbeats, no exit reported
        stopped_at = time.monotonic()
        thread.join(30)
    finally:
        launching.close_presences()
    ((when, error),) = raised
    print(f"host 0 raised {when - stopped_at:.2f} s after host 1 stopped beating: {error}")
    assert isinstance(error, HostLostError) and when - stopped_at < 6
    assert str(error).startswith(
        f'Step "train" cannot start on host 0: it lost host 1 ({socket.gethostname()}, 127.0.0.1; '
        "node rank 1): its tango process sent no heartbeat for "
    )


def test_the_outcome_of_a_run_names_the_step_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tango import Step
    from tango.common import logging as tango_logging
    from tango.common.exceptions import CliRunError

    from tango_fairscale.launch.presence import run_outcome

    class Failing(Step):
        def run(self) -> None:  # type: ignore[override]
            raise ValueError("no data on node 1")

    try:
        Failing(step_name="data").run()
    except ValueError as error:
        failed = error
    monkeypatch.setattr(tango_logging, "_EXCEPTIONS_LOGGED", [])
    assert run_outcome() == "ended"
    # Tango's own "the run finished with errors" comes after the step's error, empty.
    monkeypatch.setattr(tango_logging, "_EXCEPTIONS_LOGGED", [failed, CliRunError()])
    assert run_outcome() == 'failed: step "data" failed there: ValueError: no data on node 1'


def test_monitor_names_a_silent_host_and_not_one_that_ended() -> None:
    import time

    from tango_fairscale.launch import HostInfo, HostMonitor, HostWorld

    store = _serve_store()
    hosts = tuple(HostInfo(f"h{n}", LOCAL_ADDRESS, f"/w{n}", 1, "s", "t") for n in range(3))
    world = HostWorld(0, 1, LOCAL_ADDRESS, store.port, "a", hosts, (True, True, True))
    lost: list = []
    monitor = HostMonitor(world, host_timeout=1.5, on_lost=lost.append)
    store.set("state/2", "ended")  # host 2 finished: never lost
    monitor.start()
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.stop()
    assert lost == [1]
    assert "no heartbeat" in monitor.lost()[1]
    assert monitor.all_settled()


def test_signal_stops_the_workers(tmp_path: Path) -> None:
    """SIGTERM to this process while workers run: they are stopped, and the step ends with status 143."""
    import multiprocessing
    import os
    import signal
    import time

    from tango_fairscale.launch import stop_workers_on_signals

    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        with stop_workers_on_signals(grace=5):
            worker.start()
            # The handler has run when os.kill returns (Linux delivers a signal a process sends
            # itself to the sending thread, and CPython's os.kill runs the handler before it
            # returns), and it raises: past this line, it did not stop the step. Nothing to wait for.
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM to this process did not end the step")
    assert stopped.value.code == 128 + signal.SIGTERM
    assert not worker.is_alive()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_worker_dies_with_its_parent(tmp_path: Path) -> None:
    """
    die_with_parent: the process is killed when its parent dies, even one that ignores SIGINT
    (torch's spawn asks for SIGINT on parent death, which a worker inside a collective does not act on).
    """
    import os
    import signal
    import subprocess
    import sys
    import time

    child_code = (
        "import signal, time; from tango_fairscale.launch import die_with_parent; die_with_parent(); "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    parent_code = (
        "import subprocess, sys; "
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE, "
        "text=True); "
        "assert child.stdout.readline().strip() == 'ready'; print(child.pid, flush=True); "
        "import time; time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=tango_env()
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its parent by 10 s")


def test_the_host_that_failed_first_is_named() -> None:
    from tango_fairscale.launch.rendezvous import _first_failure

    states = {
        1: "failed 2: RuntimeError: Connection closed by peer",
        2: "failed 1: ValueError: nan loss",
        3: "ended",
    }
    assert _first_failure(states, own_order=3) == (2, "ValueError: nan loss")
    # This host reported first: its own error is the one to show.
    assert _first_failure(states, own_order=0) == (2, "ValueError: nan loss")
    assert _first_failure({1: "failed 2: x"}, own_order=1) is None
    assert _first_failure({1: "ended"}, own_order=1) is None


def test_a_worker_failure_is_summed_up_by_its_exception_line() -> None:
    from torch.multiprocessing import ProcessRaisedException

    from tango_fairscale.launch.failures import _first_line

    quoted = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise ValueError("nan loss encountered")\n'
        "ValueError: nan loss encountered\n"
    )
    assert _first_line(ProcessRaisedException(quoted, 1, 1234)) == "ValueError: nan loss encountered"
    assert _first_line(KeyboardInterrupt()) == "KeyboardInterrupt: "
    assert _first_line(RuntimeError("store gone\nmore")) == "RuntimeError: store gone"


def test_a_workers_checkpoint_error_is_told_as_its_one_line() -> None:
    from tango.common.exceptions import CliRunError
    from torch.multiprocessing import ProcessRaisedException

    from tango_fairscale.errors import CheckpointError, worker_checkpoint_error

    def quoted(last: str) -> str:
        return (
            "\n\n-- Process 0 terminated with the following error:\nTraceback (most recent call last):\n"
            '  File "x.py", line 1, in f\n    raise CheckpointError(...)\n' + last + "\n"
        )

    line = "Cannot write /disk/weights.pt: No space left on device (ENOSPC)."
    error = worker_checkpoint_error(
        ProcessRaisedException(quoted(f"tango_fairscale.errors.CheckpointError: {line}"), 0, 1234)
    )
    # Tango prints a CliRunError as its message alone; callers catching CheckpointError still do.
    assert isinstance(error, CliRunError) and isinstance(error, CheckpointError)
    assert str(error) == f"CheckpointError: {line}"
    # Any other worker error keeps its traceback.
    assert worker_checkpoint_error(ProcessRaisedException(quoted("ValueError: nan loss"), 0, 1234)) is None
    assert worker_checkpoint_error(RuntimeError(f"tango_fairscale.errors.CheckpointError: {line}")) is None


def test_a_workers_configuration_error_or_timeout_and_a_main_process_refusal_are_one_line() -> None:
    from tango.common.exceptions import CliRunError, ConfigurationError
    from torch.multiprocessing import ProcessRaisedException

    from tango_fairscale.errors import refused, worker_checkpoint_error

    def quoted(last: str) -> str:
        return (
            '\n\n-- Process 1 terminated:\nTraceback (most recent call last):\n  File "x.py"\n' + last + "\n"
        )

    timeout = "worker 1 waited 3 s (collective_timeout) to send to worker 0 in a ring all-gather"
    error = worker_checkpoint_error(
        ProcessRaisedException(
            quoted(f"tango_fairscale.cpu.collectives.CollectiveTimeoutError: {timeout}"), 1, 1
        )
    )
    assert isinstance(error, CliRunError) and str(error) == f"CollectiveTimeoutError: {timeout}"
    # The torch backend's workers that disagree on a collective (they were aborted by gloo).
    mismatch = "worker 1 was to run collective #3, the all-gather of 'b.2' where worker 0 ran ..."
    quoted_mismatch = f"tango_fairscale.backends.torch_fsdp2.collectives.CollectiveMismatchError: {mismatch}"
    error = worker_checkpoint_error(ProcessRaisedException(quoted(quoted_mismatch), 1, 1))
    assert isinstance(error, CliRunError) and str(error) == f"CollectiveMismatchError: {mismatch}"
    bad = "tango.common.exceptions.ConfigurationError: FSDPConfig.bucket_cap_mb: must be >= 0"
    error = worker_checkpoint_error(ProcessRaisedException(quoted(bad), 1, 1))
    assert (
        isinstance(error, CliRunError)
        and str(error) == "ConfigurationError: FSDPConfig.bucket_cap_mb: must be >= 0"
    )
    line = refused(
        ConfigurationError("MASTER_PORT=99999 in the environment is not a TCP port (1 to 65535).\nmore")
    )
    assert isinstance(line, CliRunError)
    assert (
        str(line)
        == "ConfigurationError: MASTER_PORT=99999 in the environment is not a TCP port (1 to 65535)."
    )
    assert refused(ValueError("not ours")) is None


def test_master_port_out_of_range_is_refused_naming_it() -> None:
    from tango.common.exceptions import ConfigurationError

    from tango_fairscale.launch import detect_launch

    with pytest.raises(ConfigurationError, match=r"^MASTER_PORT=99999 in the environment is not a TCP port"):
        detect_launch({**TORCHRUN_STATIC, "MASTER_PORT": "99999"})
    with pytest.raises(ConfigurationError, match=r"^MASTER_PORT=0 in the environment is not a TCP port"):
        detect_launch({**SLURM_STEP, "MASTER_PORT": "0"})
