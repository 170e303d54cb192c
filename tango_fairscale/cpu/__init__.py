"""
What CPU workers need, whichever the backend: all-gather and reduce-scatter as rings of gloo
transfers (:mod:`.collectives`, used by both backends' CPU paths) and a malloc setting against
heap growth (:mod:`.memory`). FairScale's CUDA stream stand-ins are the fairscale backend's
(:mod:`tango_fairscale.compat.fairscale_cpu_streams`).

These modules only define what they provide. Installing the rings into FairScale is the job of
the integration boundary, :mod:`tango_fairscale.compat`; the torch backend installs them through
FSDP2's public hooks (:mod:`tango_fairscale.backends.torch_fsdp2.collectives`).
"""
