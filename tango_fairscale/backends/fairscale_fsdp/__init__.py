"""
FairScale's FSDP as a sharding backend (:mod:`.backend`): checkpoints of flat per-unit shards
and their resharding arithmetic (:mod:`.resharding`), and the CUDA stream stand-ins FairScale
needs on CPU workers (:mod:`.cpu_streams`, installed by :mod:`tango_fairscale.compat`).

Nothing is imported here: :mod:`tango_fairscale.compat` imports :mod:`.cpu_streams` without
the backend.
"""
