"""Optional tier: real model libraries (run with `pytest -m slow`; skipped when a library is missing).

torchvision and timm need `pip install torch==2.14.1 torchvision==0.29.1 timm` in a separate environment;
transformers installs beside torch 2.13. See docs/realmodels.md.
"""
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "realmodels"
pytestmark = pytest.mark.slow


def _run(script, *args):
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=3600)
    print(proc.stdout[-5000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_huggingface_bert_gpt2_llama():
    pytest.importorskip("transformers")
    _run("check_hf.py")


def test_torchvision_classification_models():
    pytest.importorskip("torchvision")
    _run("check_vision.py")


def test_timm_convnets_and_vits():
    pytest.importorskip("timm")
    _run("check_vision.py", "--timm")


def test_modes_of_models_built_with_stochastic_depth():
    """timm ViT/DeiT/ConvNeXt with drop_path_rate=0.1, timm nfnet_f0, torchvision swin_t, Hugging Face Swin and
    DeBERTa-v2: eval deterministic and within parity, training draws as the model's, modes, float16 GEMMs, step."""
    pytest.importorskip("timm")
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    _run("check_modes.py")


def test_onnx_deployment_of_real_models():
    """torchvision ResNet-18 and RegNetX-400MF, timm ViT-Tiny, a Hugging Face BERT: ONNX files that onnxruntime
    runs within the parity bound of the float32 model, at <= 0.55x its bytes."""
    pytest.importorskip("torchvision")
    pytest.importorskip("onnxruntime")
    _run("check_onnx.py")


def test_the_converted_module_is_still_the_model():
    """Hugging Face GPT-2 and examples/train_nanogpt.py's GPT, bfloat16, blocks "auto" and None, train and eval:
    outputs within 3x autocast's error (or 1e-2), state dicts bit-equal to the float32 model's after conversion,
    resume from a checkpoint bit for bit, the model's own methods (generate, get_num_params, configure_optimizers,
    config, save_pretrained -> from_pretrained) through the converted module, and nanoGPT's own assert."""
    pytest.importorskip("transformers")
    _run("check_surface.py")
