"""
Training across hosts: one ``tango run`` per host under torchrun or srun, 2 CPU workers each.

The end-to-end tests run twice: over loopback (two node ranks on this machine, no privileges:
what CI runs) and, where root may create them, as two real hosts: two network namespaces joined
by a veth pair, each with its own address (marker ``netns``). Every host has its own workspace;
``TANGO_FAIRSCALE_SHARED_CHECKPOINTS=0`` keeps each host to its own files, as on separate disks,
except in the torchrun-restart test, which checks what a shared filesystem adds.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
from tango.common.exceptions import ConfigurationError

from tango_fairscale import checkpointing
from tango_fairscale.backends.fairscale_fsdp import resharding
from tango_fairscale.backends.lookup import holds_worker_files
from tango_fairscale.backends.torch_fsdp2 import checkpoint as torch_checkpoint
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.launch import multihost
from tango_fairscale.launch.teardown import close_process_groups
from tango_fairscale.options import EngineOptions
from tests import harness
from tests.helpers import (
    INCLUDES,
    descendants,
    load_weights,
    max_abs_difference,
    tango_command,
    tango_env,
    train_config,
    train_work_dir,
)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TOLERANCE = 1e-6
#: A host without heartbeats for this long is lost (the default is 10 s).
HOST_TIMEOUT = 3
TRAIN_STEPS = 12
RECORD_LOSSES: Dict[str, Any] = {"type": "test::record_losses"}
CALLBACKS: List[Dict[str, Any]] = [
    RECORD_LOSSES,
    # So that a host can be killed between two checkpoints.
    {"type": "test::slow_down", "seconds": 0.3},
]


def config(
    device_count: int = 2, callbacks: Optional[List[Dict[str, Any]]] = None, **overrides: Any
) -> Dict[str, Any]:
    """The experiment every test trains: the same model, data, seed and per-worker batch."""
    return train_config(
        engine="fairscale",
        wrap="root",
        device_count=device_count,
        train_steps=TRAIN_STEPS,
        checkpoint_every=3,
        callbacks=CALLBACKS if callbacks is None else callbacks,
        **overrides,
    )


# --- Unit tests -----------------------------------------------------------------------------------


def test_agree_takes_the_newest_step_every_worker_has_from_one_attempt() -> None:
    assert multihost.agree([{3: "a", 6: "a"}, {3: "a", 6: "a", 9: "a"}]) == 6
    # Step 6 was written by two attempts (host 1's by a run that died): not mixed.
    assert multihost.agree([{3: "a", 6: "a"}, {3: "a", 6: "b"}]) == 3
    assert multihost.agree([{3: "a"}, {6: "a"}]) is None
    assert multihost.agree([{}, {3: "a"}]) is None


def _fake_checkpoint(work_dir: Path, step: int, ranks: List[int], world_size: int, attempt: str) -> Path:
    directory = work_dir / f"checkpoint_state_step{step}"
    directory.mkdir(parents=True)
    for rank in ranks:
        for name in ("model", "trainer"):
            checkpointing.worker_file(directory, rank, name).write_bytes(b"x")
    part = {"host": {"node_rank": ranks[0] // 2, "num_nodes": 2, "workers": ranks, "attempt": attempt}}
    checkpointing.write_marker(directory, world_size, {"files": ["model", "trainer"], **part})
    return directory


def test_resumable_steps_of_a_host(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3, [2, 3], 4, "a")
    _fake_checkpoint(tmp_path, 6, [2, 3], 4, "a")
    (tmp_path / "checkpoint_state_step9").mkdir()  # a save that never got its marker
    checkpointing.worker_file(tmp_path / "checkpoint_state_step9", 2, "model").write_bytes(b"x")
    # Worker 3's trainer file of step 6 is gone: worker 3 cannot resume from it.
    checkpointing.worker_file(tmp_path / "checkpoint_state_step6", 3, "trainer").unlink()
    assert multihost.resumable_steps(tmp_path, 4, 2, holds_worker_files) == {3: "a", 6: "a"}
    assert multihost.resumable_steps(tmp_path, 4, 3, holds_worker_files) == {3: "a"}
    # In a world of another size only complete checkpoints count (they are resharded).
    assert multihost.resumable_steps(tmp_path, 6, 2, holds_worker_files) == {}
    marker = checkpointing.read_marker(tmp_path / "checkpoint_state_step3")
    assert marker is not None
    assert (
        multihost.describe_part(marker)
        == "host 1's part of a checkpoint written by 2 hosts (workers 2-3 of 4)"
    )


def test_a_part_resumed_elsewhere_says_how_to_gather_it(tmp_path: Path) -> None:

    part = _fake_checkpoint(tmp_path, 3, [2, 3], 4, "a")
    # Torch-backend files are a worker's too: its DCP data file.
    torch_part = _fake_checkpoint(tmp_path / "torch", 3, [2, 3], 4, "a")
    marker = checkpointing.read_marker(torch_part)
    assert marker is not None
    (torch_part / "dcp").mkdir()
    (torch_part / "dcp" / "__2_0.distcp").write_bytes(b"x")
    marker["digests"] = {
        "dcp/__2_0.distcp": {"size": 1, "sha256": "0"},
        "dcp/__3_0.distcp": {"size": 1, "sha256": "0"},
    }
    marker.update(torch_checkpoint.MARKER_FIELDS)  # the torch backend's marker: it owns the DCP files
    checkpointing.write_marker(torch_part, 4, {k: v for k, v in marker.items() if k != "world_size"})
    assert multihost.resumable_steps(tmp_path / "torch", 4, 2, holds_worker_files) == {3: "a"}
    # Worker 3's DCP file is missing.
    assert multihost.resumable_steps(tmp_path / "torch", 4, 3, holds_worker_files) == {}
    for directory in (part, torch_part):
        with pytest.raises(checkpointing.CheckpointError) as error:
            checkpointing.require_complete(directory)
        explained = str(multihost.explain_part(error.value, directory))
        assert "It is host 1's part of a checkpoint written by 2 hosts (workers 2-3 of 4)" in explained
        assert "copy every host's worker files of it" in explained


#: Sizes of the files that the hosts of the transfer test send: several chunks, exactly one, none.
_SIZES = [2500, 1000, 0]


def _transfer_world(node_rank: int, root: Path) -> Any:
    from tango_fairscale.launch import HostInfo, HostWorld

    hosts = tuple(HostInfo(f"h{n}", "127.0.0.1", str(root / f"host{n}"), 1, "s", "t") for n in range(3))
    return HostWorld(node_rank, 1, "127.0.0.1", 0, "a", hosts, (False, False, False))


def _transfer_worker(rank: int, port: int, root: str) -> None:

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3
    )
    multihost.TRANSFER_CHUNK_BYTES = 1000  # several rounds for small files
    world, base = _transfer_world(rank, Path(root)), Path(root)
    outcomes: Dict[str, Any] = {}
    for case in ("intact", "damaged", "missing"):
        directory = base / case / f"host{rank}"
        into = base / case / f"received{rank}"
        into.mkdir(parents=True)
        try:
            received = multihost.receive_missing_files(
                directory, world, lambda marker, r: f"sub/worker{r}.bin", into
            )
            outcomes[case] = {name: (into / name).read_bytes().hex() for name in sorted(received)}
        except checkpointing.CheckpointError as error:
            outcomes[case] = f"error: {error}"
    (base / f"outcome{rank}.json").write_text(json.dumps(outcomes))
    close_process_groups()


def test_hosts_exchange_the_files_they_lack_in_chunks(tmp_path: Path) -> None:
    from tests.helpers import free_port

    contents = {rank: os.urandom(size) for rank, size in enumerate(_SIZES)}
    digests = {
        f"sub/worker{rank}.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rank, data in contents.items()
    }
    for case in ("intact", "damaged", "missing"):
        for rank in range(3):
            directory = tmp_path / case / f"host{rank}"
            (directory / "sub").mkdir(parents=True)
            data = contents[rank]
            if case == "damaged" and rank == 0:
                data = bytes([data[1500] ^ 1]).join([data[:1500], data[1501:]])  # one byte of chunk 2
            if not (case == "missing" and rank == 1):
                (directory / "sub" / f"worker{rank}.bin").write_bytes(data)
            checkpointing.write_marker(directory, 3, {"files": [], "digests": digests})
    harness.spawn(_transfer_worker, args=(free_port(), str(tmp_path)), nprocs=3)
    outcomes = [json.loads((tmp_path / f"outcome{rank}.json").read_text()) for rank in range(3)]
    for rank, outcome in enumerate(outcomes):
        # Every host ends with every other host's file, byte for byte.
        assert outcome["intact"] == {
            f"sub/worker{other}.bin": contents[other].hex() for other in range(3) if other != rank
        }
    # Host 0's file changed after its marker was written: the hosts it sends to see it arrive
    # damaged, and every host raises rather than one waiting for another.
    for rank in (1, 2):
        assert "sub/worker0.bin, sent by host 0 (h0, 127.0.0.1" in outcomes[rank]["damaged"]
        assert "did not arrive as" in outcomes[rank]["damaged"]
    assert "could not check the files it received" in outcomes[0]["damaged"]
    assert "lacks this host's own file(s) ['sub/worker1.bin']" in outcomes[1]["missing"]
    for rank in (0, 2):
        assert (
            "host 1 (h1, 127.0.0.1; node rank 1, global ranks 1-1) cannot send" in outcomes[rank]["missing"]
        )


@pytest.mark.parametrize(
    "timeout, message", [(0, "must be positive"), ("300", "must be a number of seconds")]
)
def test_collective_timeout_is_checked(timeout: Any, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"collective_timeout: {message}"):
        EngineOptions(collective_timeout=timeout).check(distributed=True, device_count=2, on_cpu=True)


# --- Two hosts on this machine --------------------------------------------------------------------


def _kill(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Network:
    """Two hosts: their addresses, how to run a command on each, and how to kill one."""

    name: str
    addresses: List[str]
    namespaces: Optional[List[str]] = None

    def on(self, node: int, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.namespaces[node], *command] if self.namespaces else command

    def processes(self, node: int, launcher_pid: int) -> List[int]:
        """Every process of host ``node``: all of its namespace's, or everything its launcher started."""
        if self.namespaces:
            listed = subprocess.run(
                ["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True, check=True
            ).stdout.split()
            return [int(pid) for pid in listed]
        return [launcher_pid, *descendants(launcher_pid)]


@pytest.fixture(scope="module")
def loopback() -> Network:
    return Network("loopback", ["127.0.0.1", "127.0.0.1"])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def namespaces() -> Iterator[Network]:
    """Two network namespaces joined by a veth pair: 10.213.0.1 and 10.213.0.2, deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts as network namespaces need root and iproute2's `ip netns`")
    tag = f"tfs{os.getpid() % 100000}"
    names, veths = [f"{tag}h0", f"{tag}h1"], [f"{tag}a", f"{tag}b"]
    created: List[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
    except subprocess.CalledProcessError as error:
        for name in created:
            _ip("netns", "del", name)
        pytest.skip(f"`ip netns add` is not allowed here: {error.stderr.strip()}")
    try:
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for node, (name, veth) in enumerate(zip(names, veths)):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"10.213.0.{node + 1}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield Network("netns", ["10.213.0.1", "10.213.0.2"], names)
    finally:
        for name in names:
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            _kill([int(pid) for pid in listed.split()])
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # removes the veth pair too


@pytest.fixture(scope="module", params=["loopback", pytest.param("namespaces", marks=pytest.mark.netns)])
def network(request: pytest.FixtureRequest) -> Network:
    return request.getfixturevalue(request.param)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    assert port != 54761  # torch::train's default, which these tests never use
    return port


@dataclass
class Hosts:
    """Two ``tango run`` commands, one per host, under a launcher; started again by :meth:`start`."""

    network: Network
    root: Path
    launcher: str  # "static" or "c10d" (torchrun) or "slurm" (srun's environment)
    experiment: Dict[str, Any]
    max_restarts: int = 0
    env: Dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=_free_port)
    processes: List["subprocess.Popen[bytes]"] = field(default_factory=list)
    runs: int = 0
    #: A host's own experiment, where it differs from the others'.
    per_host: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    #: Modules ``tango run`` imports beside the tests' usual ones (``-i``).
    includes: List[str] = field(default_factory=list)

    def workspace(self, node: int) -> Path:
        return self.root / f"ws{node}"

    def log(self, node: int) -> Path:
        return self.root / f"host{node}.run{self.runs}.log"

    def command(self, node: int) -> List[str]:
        experiment = self.per_host.get(node, self.experiment)
        tango = tango_command(
            experiment, self.workspace(node), self.root / f"cwd{node}", includes=[*INCLUDES, *self.includes]
        )
        master = self.network.addresses[0]
        if self.launcher == "slurm":
            return tango
        if self.launcher == "static":
            flags = [f"--node-rank={node}", f"--master-addr={master}", f"--master-port={self.port}"]
        else:
            flags = [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={master}:{self.port}",
                "--rdzv-id=test-job",
                # Both namespaces share this machine's host name, which resolves to neither address:
                # tell torchrun each host's reachable address, and which host serves the endpoint.
                f"--local-addr={self.network.addresses[node]}",
                f"--rdzv-conf=is_host={int(node == 0)}",
            ]
        launch = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--max-restarts={self.max_restarts}", *flags]
        return [*launch, "-m", "tango", *tango[1:]]

    def environment(self, node: int) -> Dict[str, str]:
        env = {
            **tango_env(),
            "OMP_NUM_THREADS": "1",
            "TANGO_FAIRSCALE_HOST_TIMEOUT": str(HOST_TIMEOUT),
            "TANGO_FAIRSCALE_SHARED_CHECKPOINTS": "0",
            **self.env,
        }
        if self.launcher == "slurm":
            env.update(
                SLURM_JOB_ID="4242",
                SLURM_STEP_ID="0",
                SLURM_NNODES="2",
                SLURM_STEP_NUM_NODES="2",
                SLURM_STEP_NUM_TASKS="2",
                SLURM_NODEID=str(node),
                SLURM_PROCID=str(node),
                SLURM_JOB_NODELIST="testnode[0-1]",
                MASTER_ADDR=self.network.addresses[0],
                MASTER_PORT=str(self.port),
            )
        return env

    def start(self) -> None:
        self.runs += 1
        commands = [self.command(node) for node in range(2)]  # writes each host's config once
        self.processes = [
            subprocess.Popen(
                self.network.on(node, commands[node]),
                cwd=self.root / f"cwd{node}",
                env=self.environment(node),
                stdout=open(self.log(node), "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for node in range(2)
        ]

    def wait(self, timeout: float = 300) -> List[int]:
        deadline = time.monotonic() + timeout
        try:
            for process in self.processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the hosts did not finish within {timeout} s\n{self.logs()}") from None
        return [process.returncode for process in self.processes]

    def kill_all(self) -> None:
        for node, process in enumerate(self.processes):
            _kill(self.network.processes(node, process.pid))
            process.wait(timeout=30)

    def output(self, node: int) -> str:
        return self.log(node).read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- host {node} ---\n{self.output(node)[-5000:]}" for node in range(2))

    def run(self, timeout: float = 300) -> None:
        self.start()
        codes = self.wait(timeout)
        assert codes == [0, 0], f"exit codes {codes}\n{self.logs()}"

    def latest(self, node: int) -> Optional[int]:
        """The step of host ``node``'s ``checkpoint_state_latest``, or ``None``."""
        for link in self.workspace(node).glob("cache/TorchTrainStep-*/work/checkpoint_state_latest"):
            try:
                return int(os.readlink(link).rsplit("step", 1)[1])
            except (OSError, ValueError, IndexError):
                return None
        return None

    def wait_for_checkpoint(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.latest(node) or 0) >= step for node in range(2)):
                return
            if any(process.poll() is not None for process in self.processes):
                raise AssertionError(f"a host ended before checkpoint {step}\n{self.logs()}")
            time.sleep(0.05)
        self.kill_all()
        raise AssertionError(f"no checkpoint {step} on both hosts within {timeout} s\n{self.logs()}")


def _weights(hosts: Hosts, node: int) -> Dict[str, torch.Tensor]:
    return load_weights(hosts.workspace(node))


@pytest.fixture(scope="module")
def one_host_reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, torch.Tensor]:
    """The same experiment on one host with 4 workers (in the test's own workers: tests.harness)."""
    work_dir = tmp_path_factory.mktemp("one_host") / "work"
    harness.train(config(device_count=4, callbacks=[RECORD_LOSSES]), work_dir, world_size=4)
    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    # weights.pt is streamed one tensor at a time: it equals the whole state consolidated in memory.
    in_memory = consolidation.consolidate(checkpointing.resolve_checkpoint(work_dir))
    assert list(in_memory) == list(weights) and max_abs_difference(in_memory, weights) == 0.0
    return weights


_uninterrupted: Dict[str, Hosts] = {}
#: Whether the loggers extra is installed: the uninterrupted run is then watched with fairscale::wandb.
WANDB = importlib.util.find_spec("wandb") is not None


def uninterrupted(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Hosts:
    """An uninterrupted two-host run, once per network: over loopback under srun's environment, in
    the namespaces under torchrun's static rendezvous (the other tests cover the other launchers)."""
    if network.name not in _uninterrupted:
        root = tmp_path_factory.mktemp(f"two_hosts_{network.name}")
        experiment, env = config(), {}
        if WANDB:
            # Watched with fairscale::wandb (test_wandb_across_hosts_...): the same run, no other.
            experiment["steps"]["train"]["callbacks"] = [*CALLBACKS, {"type": "fairscale::wandb", "every": 1}]
            env = {"WANDB_MODE": "offline"}
            for name in ("CONFIG", "CACHE", "DATA"):
                env[f"WANDB_{name}_DIR"] = str(root / f"wandb-{name.lower()}")
        hosts = Hosts(network, root, "slurm" if network.name == "loopback" else "static", experiment, env=env)
        started = time.monotonic()
        hosts.run()
        print(f"[{network.name}] uninterrupted two-host run: {time.monotonic() - started:.1f} s")
        _uninterrupted[network.name] = hosts
    return _uninterrupted[network.name]


def test_two_hosts_train_as_one_host_with_four_workers(
    network: Network, one_host_reference: Dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> None:
    hosts = uninterrupted(network, tmp_path_factory)
    for node in range(2):
        difference = max_abs_difference(_weights(hosts, node), one_host_reference)
        print(f"[{network.name}] max |host {node} weights.pt - one host, 4 workers| = {difference:.3e}")
        assert difference <= TOLERANCE
    # Each host holds its own workers' files of each checkpoint and marks its part.
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        final = train_work_dir(hosts.workspace(node)) / f"checkpoint_state_step{TRAIN_STEPS}"
        assert sorted({int(p.name[6 : p.name.index("_")]) for p in final.glob("worker*.pt")}) == ranks
        marker = checkpointing.read_marker(final)
        assert marker is not None and marker["world_size"] == 4
        assert marker["host"]["workers"] == ranks and marker["host"]["num_nodes"] == 2
        assert not checkpointing.is_complete(final)
    # Global ranks: host 1's first worker logged as rank 2.
    assert "[rank 2]" in hosts.output(1)


@pytest.mark.extended
def test_lost_host_ends_the_others_and_a_rerun_resumes(
    network: Network, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    reference = uninterrupted(network, tmp_path_factory)
    hosts = Hosts(network, tmp_path, "static", config())
    hosts.start()
    hosts.wait_for_checkpoint(6)
    killed_at = time.monotonic()
    victims = hosts.network.processes(1, hosts.processes[1].pid)
    _kill(victims)  # every process of host 1: its torchrun, its tango, its workers
    hosts.processes[1].wait(timeout=30)
    codes = hosts.wait(timeout=120)
    seconds = time.monotonic() - killed_at
    print(f"[{network.name}] host 0 ended {seconds:.1f} s after host 1 was killed ({len(victims)} processes)")
    assert codes[0] != 0
    assert seconds < 60
    output = hosts.output(0)
    named = f"host 1 ({socket.gethostname()}, {network.addresses[1]}; node rank 1, global ranks 2-3)"
    # HostLostError is a CliRunError: tango prints its message alone, one line.
    lines = [line for line in output.splitlines() if "because it lost" in line]
    assert len(lines) == 1 and f"Training stopped on host 0 because it lost {named}" in lines[0], output[
        -4000:
    ]
    assert not (train_work_dir(hosts.workspace(0)) / "weights.pt").exists(), "the run ended before the kill"

    started = time.monotonic()
    hosts.run()
    print(f"[{network.name}] rerun after the loss: {time.monotonic() - started:.1f} s")
    for node in range(2):
        assert "Recovering from previous run" in hosts.output(node)
        resumed = hosts.output(node).split("Recovering from previous run at ")[1].split()[0]
        assert int(resumed.rsplit("step", 1)[1]) >= 6
        difference = max_abs_difference(_weights(hosts, node), _weights(reference, 0))
        print(f"[{network.name}] max |host {node} resumed - uninterrupted| = {difference:.3e}")
        assert difference <= TOLERANCE


@pytest.mark.extended
def test_torchrun_restarts_a_lost_host(
    network: Network, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """c10d rendezvous, --max-restarts=1; host 1's tango and workers die, its torchrun stays."""
    reference = uninterrupted(network, tmp_path_factory)
    # One filesystem here: with sharing on, every host's checkpoints are complete.
    hosts = Hosts(
        network, tmp_path, "c10d", config(), max_restarts=1, env={"TANGO_FAIRSCALE_SHARED_CHECKPOINTS": "1"}
    )
    started = time.monotonic()
    hosts.start()
    hosts.wait_for_checkpoint(6)
    agent = hosts.processes[1].pid
    _kill([pid for pid in hosts.network.processes(1, agent) if pid != agent])
    codes = hosts.wait(timeout=300)
    print(f"[{network.name}] run with a restart: {time.monotonic() - started:.1f} s")
    assert codes == [0, 0], hosts.logs()
    for node in range(2):
        assert "Recovering from previous run" in hosts.output(node)
        difference = max_abs_difference(_weights(hosts, node), _weights(reference, 0))
        print(f"[{network.name}] max |host {node} after restart - uninterrupted| = {difference:.3e}")
        assert difference <= TOLERANCE
        final = train_work_dir(hosts.workspace(node)) / f"checkpoint_state_step{TRAIN_STEPS}"
        assert checkpointing.is_complete(final)  # the other host's files hard-linked in


#: A data step that fails on one host only, after a delay of that host's (its module is put on
#: the hosts' PYTHONPATH by the test; run by ``tango run`` with ``-i``).
FAILING_DATA = """
import os
import time

from tango import Step

from examples.toy.components import RegressionData


@Step.register("test::data_failing_on_one_host")
class DataFailingOnOneHost(RegressionData):
    def run(self, fail_on: int = 1, delays: tuple = (0.0, 0.0)):  # type: ignore[override]
        node = int(os.environ.get("SLURM_NODEID") or os.environ["GROUP_RANK"])
        time.sleep(delays[node])
        if node == fail_on:
            raise ValueError(f"no data on node {node}")
        return super().run(in_features=8, train_size=256, validation_size=64)
"""


@pytest.mark.parametrize(
    # Both through two tango runs in the extended suite (make test's time): the rendezvous's logic
    # is tested in process (test_launch.py's presence tests).
    "failing",
    [pytest.param(1, marks=pytest.mark.extended), pytest.param(0, marks=pytest.mark.extended)],
    ids=["host1_fails", "host0_fails"],
)
def test_a_host_whose_earlier_step_fails_ends_the_others_at_once(
    network: Network, tmp_path: Path, failing: int
) -> None:
    # Host 1's data step failed and it exited 1; host 0 waited at "Starting step train" for the
    # 30-minute rendezvous, printing nothing. Each host's tango is now present to the others from
    # its start, and tells them how its run ended. The failing host fails late (8 s), so that the
    # other one is already waiting at the training step's rendezvous. Over loopback under srun's
    # environment (host 0 serves at MASTER_PORT), in the namespaces under torchrun (host 0 publishes
    # its store through the agent's).
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "failing_data.py").write_text(FAILING_DATA)
    experiment = config(callbacks=[RECORD_LOSSES])
    delays = [0.0, 0.0]
    delays[failing] = 8.0
    experiment["steps"]["data"] = {
        "type": "test::data_failing_on_one_host",
        "fail_on": failing,
        "delays": delays,
    }
    python_path = os.pathsep.join([str(tmp_path / "extra"), tango_env()["PYTHONPATH"]])
    launcher = "slurm" if network.name == "loopback" else "static"
    hosts = Hosts(network, tmp_path, launcher, experiment, env={"PYTHONPATH": python_path})
    hosts.includes = ["failing_data"]
    hosts.start()
    waiting = 1 - failing
    deadline = time.monotonic() + 240
    while hosts.processes[failing].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    failed_at = time.monotonic()
    codes = hosts.wait(timeout=max(1.0, deadline - failed_at))
    seconds = time.monotonic() - failed_at
    print(
        f"[{network.name}] host {waiting} ended {seconds:.1f} s after host {failing}'s tango exited; "
        f"exit codes {codes}"
    )
    assert codes == [1, 1], hosts.logs()
    assert seconds < 60, hosts.logs()
    output = hosts.output(waiting)
    named = (
        f'Step "train" cannot start on host {waiting}: host {failing} ({socket.gethostname()}, '
        f"{network.addresses[failing]}; "
        f'node rank {failing}) ended its tango run before reaching it, step "data" failed there: '
        f"ValueError: no data on node {failing}. Fix that host's error, then run the same command on "
        "every host again."
    )
    lines = [line for line in output.splitlines() if "cannot start on host" in line]
    print(f"[{network.name}] host {waiting}: {lines}")
    assert len(lines) == 1 and named in lines[0], hosts.logs()
    if launcher == "slurm":  # torchrun adds its own traceback of the child that failed
        assert "Traceback" not in output, output[-4000:]
    assert 'Starting step "train"' in output and 'Starting step "train"' not in hosts.output(failing)


@pytest.mark.extended
@pytest.mark.parametrize("difference", ["device_count", "lr"])
def test_hosts_that_disagree_are_told_so(network: Network, tmp_path: Path, difference: str) -> None:
    # Under torchrun, hosts with other configs (so other step ids) met on a key derived from the
    # step id, each on its own: both waited out the rendezvous timeout with nothing printed.
    other = config(device_count=3) if difference == "device_count" else config()
    if difference == "lr":
        other["steps"]["train"]["training_engine"]["optimizer"]["lr"] = 0.02
    rendezvous_timeout = 120
    hosts = Hosts(
        network,
        tmp_path,
        "c10d",
        config(),
        env={"TANGO_FAIRSCALE_RENDEZVOUS_TIMEOUT": str(rendezvous_timeout)},
        per_host={1: other},
    )
    started = time.monotonic()
    hosts.start()
    codes = hosts.wait(timeout=200)
    elapsed = time.monotonic() - started
    print(f"[{network.name}] hosts that disagree on {difference}: exit codes {codes} in {elapsed:.1f} s")
    assert all(code != 0 for code in codes), hosts.logs()
    # Both told so within the rendezvous timeout (they waited it out, silently, before).
    assert elapsed < rendezvous_timeout, hosts.logs()
    workers = {0: 2, 1: 3}
    for node in range(2):
        # Each host names the other one and the difference.
        peer = 1 - node
        expected = (
            rf"device_count: host {peer} \(.*\) has {workers[peer]} workers, host {node} has {workers[node]}"
            if difference == "device_count"
            else rf"Host {peer} \(.*\) runs step TorchTrainStep-\w+ where host {node} runs "
            r"TorchTrainStep-\w+: the step's config differs"
        )
        found = re.search(expected + r".*", hosts.output(node))
        assert found, hosts.logs()
        print(f"[{network.name}] host {node}: {found.group(0)}")


@pytest.fixture(scope="module")
def two_workers_on_one_host(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, torch.Tensor]]:
    """``weights.pt`` of the experiment on one host with 2 workers, each backend (tests.harness)."""
    root = tmp_path_factory.mktemp("one_host_two_workers")
    jobs = {
        backend: harness.Train(
            config(device_count=2, callbacks=[RECORD_LOSSES], engine_extra={"backend": backend}),
            root / backend,
        )
        for backend in ("fairscale", "torch")
    }
    for result in harness.run(list(jobs.values()), out=root / "harness"):
        result.check()
    return {
        backend: torch.load(job.work_dir / "weights.pt", weights_only=True) for backend, job in jobs.items()
    }


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_one_worker_per_host_trains_as_one_host_with_two(
    network: Network,
    two_workers_on_one_host: Dict[str, Dict[str, torch.Tensor]],
    tmp_path: Path,
    backend: str,
) -> None:
    # device_count 1 on each of two hosts, the shape of 1-GPU cloud instances: pre-flight refused it
    # ("set 'device_count' to 2 or more"), and Tango starts no process group for one device.
    experiment = config(device_count=1, callbacks=[RECORD_LOSSES], engine_extra={"backend": backend})
    hosts = Hosts(network, tmp_path, "slurm" if network.name == "loopback" else "static", experiment)
    started = time.monotonic()
    hosts.run()
    print(f"[{network.name}, {backend}] two hosts x 1 worker: {time.monotonic() - started:.1f} s")
    for node in range(2):
        difference = max_abs_difference(_weights(hosts, node), two_workers_on_one_host[backend])
        print(
            f"[{network.name}, {backend}] max |host {node} weights.pt (2 hosts x 1 worker) - "
            f"one host x 2 workers| = {difference:.3e}"
        )
        assert difference <= TOLERANCE
        # The step's result was built, with weights.pt loaded into it, and cached: the whole run,
        # not only the workers, succeeded.
        output = hosts.output(node)
        assert "Loading best weights from" in output and "No final weights were loaded" not in output
        assert 'Finished step "train"' in output, output[-3000:]
    # Host 1's only worker is global rank 1, and each host holds its own worker's part.
    assert "[rank 1]" in hosts.output(1)
    for node in range(2):
        final = train_work_dir(hosts.workspace(node)) / f"checkpoint_state_step{TRAIN_STEPS}"
        marker = checkpointing.read_marker(final)
        assert marker is not None and marker["world_size"] == 2 and marker["host"]["workers"] == [node]


def _consolidated(checkpoint_dir: Path) -> Dict[str, Any]:
    models = resharding.load_model_shards(checkpoint_dir)
    return {
        "model": resharding.consolidate_model_state(models),
        "optimizer": resharding.consolidate_optimizer_state(
            models, resharding.load_optimizer_shards(checkpoint_dir)
        ),
    }


def test_two_host_checkpoint_resumes_on_one_host(
    loopback: Network, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Hosts on separate disks: copy the parts together, then resume on one host with 2 workers."""
    hosts = uninterrupted(loopback, tmp_path_factory)
    name = f"checkpoint_state_step{TRAIN_STEPS}"
    merged = tmp_path / "merged" / name
    shutil.copytree(train_work_dir(hosts.workspace(0)) / name, merged)
    with pytest.raises(checkpointing.CheckpointError, match=r"incomplete: missing \['worker2_"):
        checkpointing.require_complete(merged)
    for path in (train_work_dir(hosts.workspace(1)) / name).glob("worker*.pt"):
        shutil.copy2(path, merged)
    assert checkpointing.is_complete(merged)

    experiment = train_config(
        engine="fairscale",
        wrap="root",
        device_count=2,
        train_steps=TRAIN_STEPS + 6,
        checkpoint_every=6,
        callbacks=[{"type": "test::save_after_load"}, RECORD_LOSSES],
        engine_extra={"resume_from_checkpoint": str(merged)},
    )
    # In the test's own workers (tests.harness): what is under test is the checkpoint.
    work_dir = tmp_path / "work"
    result = harness.train(experiment, work_dir)
    assert "Resharding checkpoint" in result.logs
    # Right after loading, the 2 workers hold exactly what the 4 workers on 2 hosts saved.
    after, saved = _consolidated(work_dir / "after_load"), _consolidated(merged)
    assert max_abs_difference(after["model"], saved["model"]) == 0.0
    for parameter, state in saved["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(
                torch.as_tensor(after["optimizer"]["state"][parameter][key]), torch.as_tensor(value)
            )
    # Training went on from step 12, where the two-host run had brought the loss.
    before = {
        int(k): v
        for k, v in json.loads((train_work_dir(hosts.workspace(0)) / "losses.json").read_text()).items()
    }
    resumed = {int(k): v for k, v in json.loads((work_dir / "losses.json").read_text()).items()}
    assert min(resumed) == TRAIN_STEPS
    first_losses = sum(before[s] for s in range(3)) / 3
    resumed_mean = sum(resumed.values()) / len(resumed)
    print(
        f"loss: first steps {first_losses:.4f}, two hosts' last {before[TRAIN_STEPS - 1]:.4f}, "
        f"resumed {resumed_mean:.4f}"
    )
    assert resumed_mean < 0.5 * first_losses


# --- The torch backend (FSDP2, DCP checkpoints) across hosts ----------------------------------------


@pytest.mark.parametrize(
    "hybrid",
    # Both extended: four tango runs across two hosts (50 s); the torch backend's host parts are
    # loaded in the harness in make test (test_torch_backend.py's checkpoint-across-hosts tests).
    [pytest.param(False, marks=pytest.mark.extended), pytest.param(True, marks=pytest.mark.extended)],
    ids=["full", "hybrid"],
)
def test_torch_backend_across_hosts_resumes_from_each_hosts_part(
    hybrid: bool, loopback: Network, one_host_reference: Dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """
    Two hosts on separate disks, backend "torch" (fully sharded over the 4 workers, or hybrid:
    sharded within a host, replicated across hosts). Host 1 is killed after a checkpoint; the
    same commands again resume from each host's own part of it and end as one host with 4
    workers does.
    """
    experiment = config(engine_extra={"backend": "torch", "hybrid_sharding": hybrid})
    hosts = Hosts(loopback, tmp_path, "slurm", experiment)
    hosts.start()
    hosts.wait_for_checkpoint(6)
    _kill(hosts.network.processes(1, hosts.processes[1].pid))
    hosts.processes[1].wait(timeout=30)
    codes = hosts.wait(timeout=120)
    assert codes[0] != 0
    assert "Training stopped on host 0 because it lost host 1" in hosts.output(0), hosts.output(0)[-4000:]
    name = "hybrid" if hybrid else "full"
    # Each host's part: its workers' DCP files and extra states, and a DCP metadata of its own.
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        part = train_work_dir(hosts.workspace(node)) / "checkpoint_state_step6"
        assert sorted(p.name for p in (part / "dcp").iterdir()) == [
            ".metadata",
            *(f"__{r}_0.distcp" for r in ranks),
        ]
        assert sorted({int(p.name[6 : p.name.index("_")]) for p in part.glob("worker*.pt")}) == ranks
        marker = checkpointing.read_marker(part)
        assert marker is not None and marker["backend"] == "torch" and marker["host"]["workers"] == ranks
        assert not checkpointing.is_complete(part)

    # The rerun as on a shared filesystem (both workspaces are on this machine's): from now on
    # each host links the other's files into its checkpoints, which are then complete.
    hosts.env["TANGO_FAIRSCALE_SHARED_CHECKPOINTS"] = "1"
    hosts.run()
    for node in range(2):
        output = hosts.output(node)
        assert "Recovering from previous run" in output, output[-4000:]
        difference = max_abs_difference(_weights(hosts, node), one_host_reference)
        print(
            f"[torch, {name}] max |host {node} resumed - one host, 4 workers (fairscale)| = {difference:.3e}"
        )
        assert difference <= TOLERANCE
        final = train_work_dir(hosts.workspace(node)) / f"checkpoint_state_step{TRAIN_STEPS}"
        assert checkpointing.is_complete(final)
        assert max_abs_difference(consolidation.consolidate(final), _weights(hosts, node)) == 0.0
    mesh = "('replicate', 'shard') 2 x 2" if hybrid else "('shard',) 4"
    assert f"Sharding over the device mesh {mesh}" in hosts.output(0)


# --- Watching a run across hosts ----------------------------------------------------------------------


def test_wandb_across_hosts_logs_every_worker_from_global_rank_zero(
    network: Network, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """
    The uninterrupted two-host run (2 workers a host) watched with fairscale::wandb in W&B's
    offline mode: one run, on host 0 only (global rank 0), every step once, each with the figures
    of all 4 workers, which reach rank 0 through the rendezvous store (no collective).
    """
    if not WANDB:
        pytest.skip("the loggers extra: pip install 'tango-fairscale[loggers]'")
    from tests.test_loggers import wandb_history

    hosts = uninterrupted(network, tmp_path_factory)
    work_dirs = [train_work_dir(hosts.workspace(node)) for node in range(2)]
    assert not (work_dirs[1] / "wandb").exists()  # host 1's workers only send their figures
    (directory,) = (work_dirs[0] / "wandb").glob("offline-run-*")
    run_id, rows = wandb_history(next(directory.glob("run-*.wandb")))
    assert directory.name.endswith(f"-{run_id}")
    losses = {
        line["step"]: line["loss"]
        for line in map(json.loads, (work_dirs[0] / "metrics.jsonl").read_text().splitlines())
        if line["kind"] == "train"
    }
    assert [step for step, _ in rows] == list(range(1, TRAIN_STEPS + 1))
    workers = sorted({key.split("/")[0] for _, values in rows for key in values if key.startswith("worker")})
    print(
        f"[{network.name}] W&B offline on host 0 only: run {run_id}, steps {[s for s, _ in rows]}, {workers}"
    )
    for step, values in rows:
        assert values["train/loss"] == pytest.approx(losses[step], rel=1e-6)
        for rank in range(4):
            assert values[f"worker{rank}/peak_memory_mib"] > 0
            assert values[f"worker{rank}/samples_per_second"] > 0
            assert 0 < values[f"worker{rank}/mfu"] <= 1
        # The toy regression batches have no tokens: samples/s only.
        assert "train/tokens_per_second" not in values and values["train/samples_per_second"] > 0
