"""
``scripts/install_torch.py``, which ``make`` runs to install PyTorch: which build it picks for
which machine, run the way ``make`` runs it (``--dry-run`` prints the pip command instead of
running it). A GPU is simulated with a fake ``nvidia-smi`` on PATH or ``--gpu``; an installed
torch with a real ``.dist-info`` record in a fresh virtualenv.
"""

import http.server
import importlib.util
import re
import shutil
import subprocess
import sys
import threading
import venv
from pathlib import Path
from types import ModuleType
from typing import Iterator, List

import pytest

from tests.helpers import REPO, free_port

SCRIPT = REPO / "scripts" / "install_torch.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install_torch = load_script()


@pytest.fixture
def bare_python(tmp_path: Path) -> Path:
    """The interpreter of a new virtualenv without torch (and without pip: --dry-run needs none)."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    return tmp_path / "venv" / "bin" / "python"


def record_torch(python: Path, version: str) -> None:
    """Record torch ``version`` as installed in ``python``'s environment, as pip does (metadata only)."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dist_info = Path(purelib) / f"torch-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A reachable stand-in for PyTorch's CPU index: an HTTP server with a ``torch/`` page."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_script(python: Path, *args: str, path: str = "") -> subprocess.CompletedProcess:
    env = {"PATH": path, "PYTHONNOUSERSITE": "1"}
    return subprocess.run(
        [str(python), str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, env=env, check=False
    )


def would_run(result: subprocess.CompletedProcess) -> List[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    commands = re.findall(r"^install_torch: would run: (.*)$", result.stdout, flags=re.MULTILINE)
    assert len(commands) <= 1, result.stdout
    return commands[0].split() if commands else []


def test_no_torch_no_gpu_installs_the_pinned_cpu_build(bare_python: Path, cpu_index: str) -> None:
    result = run_script(bare_python, "--gpu", "no", "--cpu-index-url", cpu_index)
    command = would_run(result)
    assert command == [
        str(bare_python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--index-url",
        cpu_index,
        "torch==2.13.0",
    ]
    assert f"installing the CPU build of torch==2.13.0 from {cpu_index}" in result.stdout


def test_default_cpu_index_is_pytorchs() -> None:
    # What the no-GPU choice is against the real index (reachability given: this machine may be
    # offline; the probe itself is tested above and below).
    command, notes = install_torch.decide(
        python="python",
        spec=install_torch.DEFAULT_SPEC,
        index_url=None,
        installed=None,
        requirement=install_torch.torch_requirement(),
        gpu=(False, "no NVIDIA GPU found"),
        cpu_index_url=install_torch.CPU_INDEX_URL,
        probe=(True, "answered 200"),
    )
    assert command == [
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--index-url",
        "https://download.pytorch.org/whl/cpu",
        "torch==2.13.0",
    ]


def test_unreachable_cpu_index_falls_back_to_the_default_index(bare_python: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens there
    result = run_script(bare_python, "--gpu", "no", "--cpu-index-url", closed)
    assert would_run(result) == [str(bare_python), "-m", "pip", "install", "--quiet", "torch==2.13.0"]
    assert f"{closed}/torch/ is unreachable" in result.stdout
    assert "Falling back to torch==2.13.0 from the default index" in result.stdout


def test_gpu_found_by_nvidia_smi_installs_the_default_build(bare_python: Path, tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    nvidia_smi = fake_bin / "nvidia-smi"
    nvidia_smi.write_text('#!/bin/sh\n[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    nvidia_smi.chmod(0o755)
    # No CPU index is given: the GPU choice must not need (or probe) it.
    result = run_script(bare_python, path=str(fake_bin))
    assert would_run(result) == [str(bare_python), "-m", "pip", "install", "--quiet", "torch==2.13.0"]
    assert (
        "`nvidia-smi -L` lists 1 GPU(s): installing torch==2.13.0, the default (CUDA) build." in result.stdout
    )
    assert "unreachable" not in result.stdout


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.11.0", "2.15.0+cu132"])
def test_installed_torch_in_range_installs_nothing(bare_python: Path, cpu_index: str, version: str) -> None:
    record_torch(bare_python, version)
    result = run_script(bare_python, "--gpu", "no", "--cpu-index-url", cpu_index)
    assert would_run(result) == []
    assert (
        f"torch {version} is already installed (needs torch>=2.11,<2.16): installing nothing."
        in result.stdout
    )


def test_the_running_torch_is_kept() -> None:
    # The test environment's own torch (make installed it): in range, so nothing to do.
    result = run_script(Path(sys.executable), "--gpu", "no")
    assert would_run(result) == []
    assert "is already installed" in result.stdout


def test_installed_torch_out_of_range_is_an_error(bare_python: Path) -> None:
    record_torch(bare_python, "2.10.0")
    result = run_script(bare_python, "--gpu", "yes")
    assert result.returncode == 1
    assert "torch 2.10.0 is installed, but tango-fairscale needs torch>=2.11,<2.16" in result.stderr
    assert "would run" not in result.stdout


def test_overrides(bare_python: Path, tmp_path: Path) -> None:
    index = "https://example.invalid/simple"
    result = run_script(bare_python, "--gpu", "no", "--index-url", index)
    assert would_run(result) == [
        str(bare_python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--index-url",
        index,
        "torch==2.13.0",
    ]
    assert "unreachable" not in result.stdout  # an explicit index is used as given, never probed

    wheel = str(tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    result = run_script(bare_python, "--gpu", "no", "--spec", wheel)
    assert would_run(result) == [str(bare_python), "-m", "pip", "install", "--quiet", wheel]

    result = run_script(bare_python, "--gpu", "yes", "--spec", "torch==2.16.0")
    assert result.returncode == 1
    assert "torch==2.16.0 is outside torch>=2.11,<2.16" in result.stderr


def test_detect_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    monkeypatch.setenv("PATH", str(fake_bin))
    no_proc = tmp_path / "no-proc"
    assert install_torch.detect_gpu(no_proc)[0] is False  # no nvidia-smi, no driver

    nvidia_smi = fake_bin / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found'\nexit 6\n")
    nvidia_smi.chmod(0o755)
    assert install_torch.detect_gpu(no_proc)[0] is False  # a driver without a GPU

    nvidia_smi.write_text("#!/bin/sh\necho 'GPU 0: A (UUID: 0)'\necho 'GPU 1: B (UUID: 1)'\n")
    assert install_torch.detect_gpu(no_proc) == (True, "`nvidia-smi -L` lists 2 GPU(s)")

    nvidia_smi.unlink()
    proc = tmp_path / "proc-gpus"
    (proc / "0000:01:00.0").mkdir(parents=True)
    assert install_torch.detect_gpu(proc) == (True, f"{proc} lists a GPU")


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.11.0", True),
        ("2.13.0+cpu", True),
        ("2.15.9", True),
        ("2.10.1", False),
        ("2.16.0", False),
        ("3.0", False),
    ],
)
def test_satisfies_the_pyproject_range(version: str, expected: bool) -> None:
    assert install_torch.satisfies(version, install_torch.torch_requirement()) is expected


def test_makes_defaults_agree_with_pyproject() -> None:
    assert install_torch.torch_requirement() == ">=2.11,<2.16"
    makefile = (REPO / "Makefile").read_text()
    make_spec = re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, flags=re.MULTILINE)
    assert make_spec is not None and make_spec.group(1) == install_torch.DEFAULT_SPEC
    assert install_torch.satisfies(
        install_torch.DEFAULT_SPEC.split("==")[1], install_torch.torch_requirement()
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_passes_its_variables_to_the_script(bare_python: Path) -> None:
    venv_dir = bare_python.parent.parent
    result = subprocess.run(
        [
            "make",
            "-n",
            "install",
            f"VENV={venv_dir}",
            "TORCH_INDEX_URL=https://example.invalid/whl",
            "TORCH_SPEC=torch==2.13.1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        f'{venv_dir}/bin/python scripts/install_torch.py --spec "torch==2.13.1" --index-url "https://example.invalid/whl"'
        in result.stdout
    )
