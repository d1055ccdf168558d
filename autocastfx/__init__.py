"""autocastfx: any PyTorch model as an explicit mixed-precision torch.fx program."""
from .api import ConvertInfo, convert, float32_state_dict, float32_weights, master_parameters, materialize
from .capture import CaptureError
from .checks import StepError
from .devices import SlowDtypeWarning
from .diagnose import GradHistogram, calibrate, grad_histogram
from .distributed import load_checkpoint, save_checkpoint, shard, train_step
from .export import ExportCheckError, ExportError, FormatError, export, load, save
from .inference import for_inference
from .graphed import CudaGraphStep
from .plan import CastPlan
from .recompute import checkpoint_blocks, compile_blocks
from .policy import OpClass, Policy
from .report import Report, report
from .rewrite import Decision
from .scaling import LossScaleError
from .step import StepStats, TrainStep

__all__ = ["convert", "report", "master_parameters", "Policy", "OpClass", "Report", "CastPlan", "Decision",
           "ConvertInfo", "CaptureError", "train_step", "TrainStep", "StepStats", "LossScaleError", "StepError",
           "export", "save", "load", "FormatError", "ExportCheckError", "ExportError", "for_inference", "calibrate",
           "grad_histogram", "GradHistogram", "CudaGraphStep", "shard", "save_checkpoint", "load_checkpoint",
           "checkpoint_blocks", "compile_blocks", "float32_state_dict", "float32_weights", "materialize",
           "SlowDtypeWarning"]
__version__ = "0.1.0"
