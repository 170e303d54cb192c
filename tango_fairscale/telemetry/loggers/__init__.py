"""
The callbacks that show a training run where users watch it: ``fairscale::wandb`` (Weights &
Biases), ``fairscale::tensorboard`` (TensorBoard event files) and ``fairscale::profile``
(``torch.profiler`` Chrome traces). W&B and TensorBoard are optional dependencies
(``pip install 'tango-fairscale[loggers]'``), imported only by the worker that writes.
"""

from .base import RankZeroLogger
from .profiler import ProfileCallback
from .tensorboard_logger import TensorBoardLogger
from .wandb_logger import WandbLogger

__all__ = ["ProfileCallback", "RankZeroLogger", "TensorBoardLogger", "WandbLogger"]
