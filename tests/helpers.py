"""Running real ``tango run`` commands from the tests, and finding what they produced."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
#: The ``tango`` command of this interpreter's environment; where packages were installed elsewhere
#: (``pip install --target`` on a GPU machine, its scripts on the PATH), the PATH's.
TANGO = str(Path(sys.executable).with_name("tango"))
if not Path(TANGO).exists():
    TANGO = shutil.which("tango") or TANGO
INCLUDES = ["tango_fairscale", "examples.toy.components", "tests.components"]
README = (REPO / "README.md").read_text()


def markdown_text(doc: str) -> str:
    """The text of ``doc``, a Markdown file given relative to the repository (``"docs/checkpoints.md"``)."""
    return README if doc == "README.md" else (REPO / doc).read_text()


def readme_blocks(language: str, doc: str = "README.md") -> List[str]:
    """The fenced code blocks in ``language`` of the README (or of ``doc``), in order."""
    return [
        m.group(2)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", markdown_text(doc), re.M | re.S)
        if m.group(1) == language
    ]


def readme_block_with(language: str, text: str, doc: str = "README.md") -> str:
    """The one block in ``language`` of the README (or of ``doc``) that holds ``text``."""
    (found,) = [block for block in readme_blocks(language, doc) if text in block]
    return found


def readme_command_lines(language: str, text: str, doc: str = "README.md") -> List[str]:
    """
    The commands of the README's (or ``doc``'s) block holding ``text``, continuation lines joined,
    comments dropped.
    """
    joined = readme_block_with(language, text, doc).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


#: A tiny Llama (transformers' ``LlamaConfig`` fields) with its LM head tied to the token embedding.
TINY_LLAMA: Dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}


def pretrained_name(key: str) -> str:
    """The pretrained file's name of a frozen base tensor in a LoRA ``PeftModel``'s state dict."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of ``vocab_size`` words ``w0``, ``w1``, ... (nothing to download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")


def save_tiny_llama(directory: Path, config: Dict[str, Any], seed: int) -> Path:
    """A Llama of ``config`` initialised from ``seed``, saved in ``directory`` as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(directory)
    return directory


def toy_model(num_blocks: int = 4, width: int = 32) -> Dict[str, Any]:
    return {"type": "toy::regressor", "in_features": 8, "width": width, "num_blocks": num_blocks}


def train_config(
    *,
    engine: str = "fairscale",
    wrap: str = "root",
    device_count: int = 2,
    train_steps: int = 12,
    checkpoint_every: int = 6,
    validate: bool = False,
    fsdp_config: Optional[Dict[str, Any]] = None,
    engine_extra: Optional[Dict[str, Any]] = None,
    model: Optional[Dict[str, Any]] = None,
    callbacks: Optional[List[Dict[str, Any]]] = None,
    seed: int = 7,
) -> Dict[str, Any]:
    """
    A ``torch::train`` experiment on the toy regression problem. ``wrap`` is ``"root"`` (FSDP
    on the root only), ``"nested"`` (each block its own unit), ``"nested_ckpt"`` (and
    activation checkpointing) or ``"none"`` (the plain model, for the ``"torch"`` engine).
    """
    base_model = model or toy_model()
    if wrap in ("nested", "nested_ckpt"):
        model_config: Dict[str, Any] = {
            "type": "fairscale::with_wrapped_modules",
            "model": base_model,
            "modules_to_wrap": ["blocks\\.[0-9]+"],
            "fsdp_config": fsdp_config or {},
            "activation_checkpointing": wrap == "nested_ckpt",
        }
    else:
        model_config = base_model
    engine_config: Dict[str, Any] = {
        "type": engine,
        "optimizer": {"type": "torch::AdamW", "lr": 0.01, "weight_decay": 0.01},
        "lr_scheduler": {"type": "torch::StepLR", "step_size": 4, "gamma": 0.5},
        **(engine_extra or {}),
    }
    if engine == "fairscale" and fsdp_config is not None:
        engine_config["fsdp_config"] = fsdp_config
    train: Dict[str, Any] = {
        "type": "torch::train",
        "model": model_config,
        "training_engine": engine_config,
        "dataset_dict": {"type": "ref", "ref": "data"},
        "train_dataloader": {
            "batch_size": 8,
            "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True, "seed": 3},
        },
        "train_steps": train_steps,
        "checkpoint_every": checkpoint_every,
        "log_every": 1,
        "device_count": device_count,
        "seed": seed,
        "callbacks": callbacks if callbacks is not None else [{"type": "test::record_state_sizes"}],
    }
    if validate:
        train["validation_split"] = "validation"
        train["validate_every"] = checkpoint_every
        train["validation_dataloader"] = {
            "batch_size": 16,
            "sampler": {"type": "torch::DistributedSampler", "shuffle": False, "drop_last": True},
        }
    return {
        "steps": {
            "data": {
                "type": "toy::regression_data",
                "in_features": 8,
                "train_size": 256,
                "validation_size": 64,
            },
            "train": train,
        }
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tango_command(
    config: Dict[str, Any], workspace: Path, cwd: Path, includes: Optional[List[str]] = None
) -> List[str]:
    """
    Write ``config`` to ``cwd/config.json`` and return the ``tango run`` command for it. Each
    training step gets a free port (Tango's default one would clash between concurrent runs);
    the port is not part of a step's identity, so a re-run still resumes the same step.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))
    for step in config["steps"].values():
        if step.get("type") == "torch::train":
            step["distributed_port"] = free_port()
    config_path = cwd / "config.json"
    config_path.write_text(json.dumps(config, indent=2))
    command = [TANGO, "--log-level", "info", "run", str(config_path), "-w", str(workspace)]
    for include in includes if includes is not None else INCLUDES:
        command += ["-i", include]
    return command


def tango_env() -> Dict[str, str]:
    # The variables that set numpy's OpenBLAS threads are left out, so that the runs get the
    # package's default whatever the shell sets.
    from tango_fairscale.cpu.threads import BLAS_VARIABLES

    inherited = {name: value for name, value in os.environ.items() if name not in BLAS_VARIABLES}
    return {**inherited, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_tango(
    config: Dict[str, Any],
    workspace: Path,
    *,
    cwd: Path,
    includes: Optional[List[str]] = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``tango run`` on ``config`` in a fresh process, the way a user would."""
    command = tango_command(config, workspace, cwd, includes)
    result = subprocess.run(
        command, cwd=cwd, env=tango_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"tango run failed with exit code {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
            f"\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result


@dataclass(frozen=True)
class Command:
    """A command to start: its arguments, where, and its environment (default: this process's)."""

    argv: List[str]
    cwd: Path = REPO
    env: Optional[Dict[str, str]] = None


def python_command(script: str, env: Optional[Dict[str, str]] = None) -> Command:
    """``python -c script`` in the repository."""
    return Command([sys.executable, "-c", script], env=env)


class ConcurrentProcesses:
    """
    Commands all started at once, so that their start-ups overlap: each spends seconds importing
    torch, Tango and whatever it checks, mostly on one core. A test reads its own command's result
    with :meth:`result`; :meth:`close` kills any still running and closes the pipes.
    """

    def __init__(self, commands: Dict[str, Command]) -> None:
        self._processes: Dict[str, subprocess.Popen] = {}
        self._results: Dict[str, subprocess.CompletedProcess] = {}
        try:
            for name, command in commands.items():
                self._processes[name] = subprocess.Popen(
                    command.argv,
                    cwd=command.cwd,
                    env=command.env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
        except BaseException:
            self.close()
            raise

    def result(self, name: str, timeout: float = 300) -> subprocess.CompletedProcess:
        if name not in self._results:
            process = self._processes[name]
            stdout, stderr = process.communicate(timeout=timeout)
            self._results[name] = subprocess.CompletedProcess(
                process.args, process.returncode, stdout, stderr
            )
        return self._results[name]

    def close(self) -> None:
        for process in self._processes.values():
            if process.poll() is None:
                process.kill()
            process.communicate()  # reaps it and closes its pipes


def error_lines(output: str) -> List[str]:
    """The messages of the ERROR lines of a ``tango run``'s output, without their source location."""
    return [
        # The location is a path relative to an entry of sys.path (site-packages has a hyphen).
        re.sub(r"\s+\S+\.py:\d+$", "", line.split(" ERROR ", 1)[1]).strip()
        for line in output.splitlines()
        if " ERROR " in line
    ]


def one_line_error(output: str) -> str:
    """
    The error of a failed ``tango run`` (its output), after asserting that it is told as one line:
    no traceback anywhere, and after that line only Tango's summary of the step and the run.
    """
    assert "Traceback" not in output, output[-6000:]
    errors = error_lines(output)
    assert len(errors) == 3 and errors[1].startswith("✗ Step ") and errors[1].endswith(" failed"), errors
    assert errors[2].startswith("✗ Run ") and errors[2].endswith(" finished with errors"), errors
    return errors[0]


def train_work_dir(workspace: Path) -> Path:
    """The work directory of the (single) ``torch::train`` step in ``workspace``."""
    dirs = sorted(workspace.glob("cache/TorchTrainStep-*/work"))
    assert len(dirs) == 1, f"expected one training step in {workspace}, found {dirs}"
    return dirs[0]


def load_weights(workspace: Path) -> Dict[str, torch.Tensor]:
    return torch.load(train_work_dir(workspace) / "weights.pt", map_location="cpu", weights_only=True)


def max_abs_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"different keys: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def kill_after_checkpoint(
    config: Dict[str, Any], workspace: Path, cwd: Path, checkpoint: str = "checkpoint_state_step6"
) -> Path:
    """
    Start ``tango run`` on ``config`` and SIGKILL it (the main process and every worker) as soon
    as ``checkpoint_state_latest`` points at ``checkpoint``; return the step's work directory.
    Tango moves the link only after the engine's save_checkpoint returned (the marker is
    written inside it), so a rerun must resume from that checkpoint or a later one.
    """
    process = subprocess.Popen(
        tango_command(config, workspace, cwd),
        cwd=cwd,
        env=tango_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not _latest_is(workspace, checkpoint):
            if time.monotonic() > deadline:
                raise AssertionError(f"checkpoint_state_latest did not point at {checkpoint} within 240 s")
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    work_dir = train_work_dir(workspace)
    assert not (work_dir / "weights.pt").exists(), "the run finished before it was killed"
    return work_dir


def _latest_is(workspace: Path, checkpoint: str) -> bool:
    for link in workspace.glob("cache/TorchTrainStep-*/work/checkpoint_state_latest"):
        try:
            return os.path.basename(os.readlink(link)) == checkpoint
        except OSError:  # replaced right now: look again
            return False
    return False


def dump_stacks(*pids: int) -> None:
    """
    Have each of ``pids`` and every process below them print their threads' Python stacks to their
    standard error or the file they named (tests/components.py and tests/harness.py register the
    handler in each process): what a test shows of a run that did not end in time.
    """
    for process in [every for pid in pids for every in (pid, *descendants(pid))]:
        try:
            os.kill(process, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2.0)  # each process writes its stacks from its own signal handler


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc in one pass."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def build_both(
    build: Callable[[], nn.Module], materialize: Callable[[nn.Module], None], seed: int = 13
) -> Tuple[nn.Module, nn.Module]:
    """The eager build and the build on meta (materialised by ``materialize``), from one seed; the
    random generator is where the eager build left it after both the build and materialising."""
    torch.manual_seed(seed)
    eager = build()
    after_eager = torch.random.get_rng_state()
    torch.manual_seed(seed)
    from tango_fairscale.materialize import check_initialisable, parameters_on_meta

    with parameters_on_meta():
        built = build()
    assert torch.equal(torch.random.get_rng_state(), after_eager)
    check_initialisable(built)
    materialize(built)
    assert torch.equal(torch.random.get_rng_state(), after_eager)
    return eager, built


def peak_allocated_bytes(profiled: Any, within: Optional[List[Tuple[int, int]]] = None) -> int:
    """
    The most CPU tensor memory allocated during a profiled span that was alive at once, above the
    span's start: the allocator's records in time order, each free counted only where the span
    allocated that block. The profiler's table of block sizes outlives a span, so a block that
    was allocated before it at an address an earlier span used shows up as a free of the old
    size; counting it would lower the peak by a block that has nothing to do with the span.
    ``within``: (start, end) times in ns; only moments inside one of them can be the peak.
    """
    from torch._C._profiler import _EventType

    records: List[Tuple[int, int, int]] = []
    nodes = list(profiled.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            records.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    live: Dict[int, int] = {}
    alive = peak = 0
    for at, ptr, size in sorted(records):
        if size > 0:
            live[ptr] = size
            alive += size
        elif ptr in live:
            alive -= live.pop(ptr)
        if within is None or any(start <= at <= end for start, end in within):
            peak = max(peak, alive)
    return peak
