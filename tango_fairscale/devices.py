"""
Where a training worker computes: the one place that decides "is this a CPU worker".

Tango gives each ``torch::train`` worker a device: a GPU index when the machine has at least
``device_count`` GPUs, else ``-1`` (a CPU process), and starts the process group on NCCL for GPU
workers and on gloo for CPU workers. So in the main process the device list decides, and in a
worker the process group's backend does (the same fact, seen after ``init_process_group``).
Every other module asks here.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def devices_are_cpu(devices: Optional[Sequence[int]]) -> bool:
    """In Tango's main process: whether the workers of a step with these devices are CPU processes."""
    return bool(devices) and all(device < 0 for device in devices or ())


def worker_computes_on_cpu() -> bool:
    """
    In a worker (or any process): whether FSDP units created now compute on the CPU. True when
    CUDA is missing, or when the default process group runs on gloo (Tango's choice for CPU
    workers, also on machines that have fewer GPUs than ``device_count``).
    """
    if not torch.cuda.is_available():
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def worker_device() -> torch.device:
    """The compute device of FSDP units created now in this worker."""
    if worker_computes_on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
