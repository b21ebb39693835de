"""The minimal model runner: a DeepSeek-V4-shaped mHC model driven end to end through
spkernels' typed functions (spkernels.api) with TP, per-forward SP dispatch and full decode CUDA graphs."""

from .config import PRESETS, ModelConfig, preset
from .engine import Engine, Request, schedule
from .launch import RunOptions, compare, launch, plan, worker
from .model import Batch, Model
from .weights import load_weights, random_weights, save_weights

__all__ = [
    "PRESETS",
    "Batch",
    "Engine",
    "Model",
    "ModelConfig",
    "Request",
    "RunOptions",
    "compare",
    "launch",
    "load_weights",
    "plan",
    "preset",
    "random_weights",
    "save_weights",
    "schedule",
    "worker",
]
