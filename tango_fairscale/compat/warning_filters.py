"""The warnings filters (W1-W5): about FairScale's and Tango's internals, nothing a user can act on."""


# --- W1: a warning about FairScale's internals ---------------------------------------------------------


def silence_internal_warnings() -> None:
    """
    FairScale calls ``Tensor.storage()``, and torch warns once per process that ``TypedStorage``
    is deprecated: one line per worker, every run, about FairScale's internals, nothing a user
    can act on. Only that warning, only when FairScale's code triggers it, is silenced.
    """
    import warnings

    # W1 upstream: none found
    warnings.filterwarnings(
        "ignore", message="TypedStorage is deprecated", category=UserWarning, module=r"fairscale\."
    )
    # FairScale's checkpoint wrapper feeds a tensor that requires grad into every checkpointed
    # call, so the block's parameters always get gradients, but it still runs torch's input
    # check, which warns "Gradients will be None" whenever the block's own inputs do not require
    # grad (e.g. the first block after the embedding of integer token ids). The warning is false
    # there; silenced for warnings raised from that one FairScale module only.
    # W2 upstream: none found
    warnings.filterwarnings(
        "ignore",
        message="None of the inputs have requires_grad=True",
        category=UserWarning,
        module=r"fairscale\.nn\.checkpoint\.checkpoint_activations",
    )
    # W4: FairScale's ShardedGradScaler (float16 AMP on GPUs) subclasses torch.cuda.amp.GradScaler,
    # whose constructor torch deprecated for torch.amp.GradScaler("cuda"): a FutureWarning in every
    # worker of every float16 run (seen on the first GPU run), about FairScale's code.
    # W4 upstream: none found
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.cuda\.amp\.GradScaler\(args\.\.\.\)` is deprecated",
        category=FutureWarning,
        module=r"fairscale\.optim\.grad_scaler",
    )
    # W3: Tango imports pkg_resources to record the installed packages of every step it runs, and
    # setuptools warns that the module is deprecated: one line in every run, about Tango's code.
    # W3 upstream: none found
    warnings.filterwarnings(
        "ignore", message="pkg_resources is deprecated", category=Warning, module=r"tango\.step_info"
    )
    # W5: Tango stamps each step's start with datetime.utcnow(), which Python 3.12 deprecates: one
    # DeprecationWarning in every tango run there, about Tango's code (ai2-tango 1.3.2 is frozen).
    # W5 upstream: none found
    warnings.filterwarnings(
        "ignore",
        message=r"datetime\.datetime\.utcnow\(\) is deprecated",
        category=DeprecationWarning,
        module=r"tango\.common\.util",
    )
