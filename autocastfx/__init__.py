"""autocastfx: any PyTorch model as an explicit mixed-precision torch.fx program."""
from .api import (ConvertInfo, ConvertOptions, convert, convert_graph, float32_state_dict, float32_weights,
                  master_parameters, materialize)
from .base.errors import CaptureError
from .training.checks import StepError
from .core.devices import SlowDtypeWarning
from .tools.diagnose import GradHistogram, calibrate, grad_histogram
from .training.checkpoints import load_checkpoint, save_checkpoint
from .training.factory import train_step
from .training.sharding import shard
from .tools.export import ExportCheckError, ExportError, FormatError, export, load, save
from .tools.inference import for_inference
from .training.graphed import CudaGraphStep
from .core.plan import CastPlan
from .training.recompute import checkpoint_blocks, compile_blocks
from .core.policy import OpClass, Policy
from .tools.report import Report, report
from .core.rewrite import Decision
from .training.scaling import LossScaleError
from .training.step import StepStats, TrainStep
from .training.heap import keep_cpu_memory

__all__ = ["convert", "convert_graph", "ConvertOptions", "report", "master_parameters", "Policy", "OpClass", "Report", "CastPlan", "Decision",
           "ConvertInfo", "CaptureError", "train_step", "TrainStep", "StepStats", "LossScaleError", "StepError",
           "export", "save", "load", "FormatError", "ExportCheckError", "ExportError", "for_inference", "calibrate",
           "grad_histogram", "GradHistogram", "CudaGraphStep", "shard", "save_checkpoint", "load_checkpoint",
           "checkpoint_blocks", "compile_blocks", "float32_state_dict", "float32_weights", "materialize",
           "SlowDtypeWarning", "keep_cpu_memory"]
__version__ = "0.1.0"
