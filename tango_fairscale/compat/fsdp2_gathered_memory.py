"""
FSDP2's gathered parameters on a CPU worker, each in a memory mapping of its own (patch S1 in
:mod:`tango_fairscale.compat` routes FSDP2's ``alloc_storage``, ``free_storage`` and
``FSDPParam.init_all_gather_outputs`` here; this module rebinds nothing).

Why: FSDP2 gathers a unit into one tensor per parameter and frees their storage when the unit
reshards. Through torch's CPU allocator those are glibc allocations: under the torch backend's
4 MiB mmap threshold (``TorchBackend.cpu_mmap_threshold``) a Llama layer's attention projections
(0.75 and 2.25 MiB at width 768) come from the main heap, between the tensors a step keeps (each
checkpointed layer's input), and glibc serves the next unit's from those holes before it maps
anything, so the heap grew by megabytes per layer that no live tensor held (``docs/capacity.md``,
"LoRA vs full fine-tuning"). FairScale's flat parameter is one mapping per unit, unmapped at
reshard; this gives FSDP2's per-parameter tensors the same: a private anonymous mapping per
tensor of :data:`OWN_MAPPING_MIN_BYTES` or more, unmapped when FSDP2 frees it. Private, so
``RLIMIT_DATA`` counts it as it counts the heap.

How: the storage FSDP2 keeps (the parameter it hands to the module is a view of it) is never
replaced; only its data is swapped in and out (``UntypedStorage._swap_data_ptr_``), so every view
sees the new memory as it saw ``resize_``'s. While gathered the storage holds the mapping (and is
not resizable: nothing of FSDP2's resizes a gathered output); when freed it holds an empty,
resizable one again and the mapping is released with the last reference to it.
"""

import functools
import mmap
from typing import Any, Callable, List, Sequence

import torch

from ..cpu.memory import malloc_advises_huge_pages

#: Gathered tensors smaller than this stay with torch's allocator (a Llama layer's norms and a LoRA
#: adapter's matrices: kilobytes, which a mapping each would round up to pages).
OWN_MAPPING_MIN_BYTES = 64 << 10


#: Mappings this large are advised transparent huge pages where the worker's malloc is
#: (``cpu.memory.malloc_advises_huge_pages``): one page fault per 2 MiB, as glibc's own mappings.
_HUGE_PAGE_BYTES = 2 << 20


@functools.lru_cache(maxsize=1)
def _advise_huge_pages() -> bool:
    # Read once: the variable is set for a worker when it is spawned and does not change after.
    return malloc_advises_huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")


def own_mapping_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of ``nbytes`` in a private anonymous mapping, unmapped when its data is released."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE_BYTES and _advise_huge_pages():
        mapping.madvise(mmap.MADV_HUGEPAGE)
    # The storage holds the mapping object; dropping its data drops the last reference, which unmaps.
    return torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()


def in_own_mapping(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage holds an own mapping (as :func:`alloc_storage` leaves it)."""
    storage = tensor.untyped_storage()
    return storage.size() > 0 and not storage.resizable()


def _wanted(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.numel() * tensor.itemsize >= OWN_MAPPING_MIN_BYTES


def alloc_storage(tensor: torch.Tensor, original: Callable[[torch.Tensor], None]) -> None:
    """FSDP2's ``alloc_storage``: ``tensor``'s empty storage at full size, in an own mapping where wanted."""
    storage = tensor.untyped_storage()
    size = tensor.numel() * tensor.itemsize
    if storage.size() == size:
        return
    if storage.size() != 0 or not _wanted(tensor):
        original(tensor)
        return
    storage._swap_data_ptr_(own_mapping_storage(size))  # type: ignore[attr-defined]


def free_storage(tensor: torch.Tensor, original: Callable[[torch.Tensor], None]) -> None:
    """FSDP2's ``free_storage``: release ``tensor``'s data, unmapping an own mapping."""
    if in_own_mapping(tensor):
        tensor.untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0))  # type: ignore[attr-defined]
        return
    original(tensor)


def init_all_gather_outputs(
    fsdp_param: Any,
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    world_size: int,
    device: torch.device,
    original: Callable[..., None],
) -> None:
    """
    ``FSDPParam.init_all_gather_outputs``: the first gather's outputs, on the CPU in own mappings
    where :func:`_wanted` (FSDP2 would ``torch.empty`` them, in the heap, and free them into it at
    the first reshard), elsewhere as FSDP2 makes them.
    """
    if fsdp_param.all_gather_outputs:
        return
    if torch.device(device).type != "cpu":
        original(fsdp_param, numels, dtypes, world_size, device)
        return
    outputs: List[torch.Tensor] = []
    for numel, dtype in zip(numels, dtypes):
        count = numel * world_size
        nbytes = count * dtype.itemsize
        if nbytes < OWN_MAPPING_MIN_BYTES:
            outputs.append(torch.empty(count, dtype=dtype))
            continue
        output = torch.empty(0, dtype=dtype)
        output.set_(own_mapping_storage(nbytes), 0, (count,))  # type: ignore[call-overload]
        outputs.append(output)
    fsdp_param.all_gather_outputs = outputs
