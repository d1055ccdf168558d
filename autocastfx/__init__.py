"""autocastfx: any PyTorch model as an explicit mixed-precision torch.fx program."""
from .api import ConvertInfo, ConvertOptions, convert, convert_graph, master_parameters, materialize
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
           "checkpoint_blocks", "compile_blocks", "materialize",
           "SlowDtypeWarning", "keep_cpu_memory"]
__version__ = "0.1.0"

# names of the time when a converted module held low copies of the weights: its parameters are now the float32 model
_GONE = {
    "float32_state_dict": "gm.state_dict() is the float32 model (the model's keys and tensors): use it",
    "float32_weights": "gm's parameters are the float32 weights: initialise gm.named_parameters() directly, with no "
                       "context around it",
}


def __getattr__(name: str):
    if name in _GONE:
        raise AttributeError(f"autocastfx.{name} is gone: {_GONE[name]}")
    raise AttributeError(f"module 'autocastfx' has no attribute {name!r}")
