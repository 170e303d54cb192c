"""
What FairScale's FSDP needs to run on CPU workers: stand-ins for CUDA streams
(:mod:`.streams`), all-gather and reduce-scatter as rings of gloo transfers
(:mod:`.collectives`) and a malloc setting against heap growth (:mod:`.memory`).

These modules only define the replacements. Installing them into FairScale is the job of the
integration boundary, :mod:`tango_fairscale.compat`.
"""
