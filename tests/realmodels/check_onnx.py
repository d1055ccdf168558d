"""ONNX deployment of real models: torchvision ResNet-18 and RegNetX-400MF (grouped convolutions; MobileNets and EfficientNets give outputs of 1e-9 at random init, too small to compare), timm ViT-Tiny, a Hugging Face BERT (the
layer sizes of bert-base, 4 layers, from a config: offline). Each: converted in eval mode, written by
autocastfx.export(gm, "m.onnx") (checked in onnxruntime by the export itself), run in onnxruntime against the
float32 model, next to torch.autocast's error in the same run; bytes against the float32 model's ONNX file.

Run with an environment that has torchvision, timm, transformers, onnx, onnxscript and onnxruntime:
    python tests/realmodels/check_onnx.py
"""
import os
import sys
import tempfile
import time
import warnings

import torch

import autocastfx


def rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


def size(path):
    data = path + ".data"
    return os.path.getsize(path) + (os.path.getsize(data) if os.path.exists(data) else 0)


def models():
    import timm
    import torchvision
    import transformers as tf
    torch.manual_seed(0)
    yield "torchvision resnet18", torchvision.models.resnet18().eval(), torch.randn(2, 3, 224, 224), None
    yield "torchvision regnet_x_400mf", torchvision.models.regnet_x_400mf().eval(), \
        torch.randn(2, 3, 224, 224), None
    yield "timm vit_tiny_patch16_224", timm.create_model("vit_tiny_patch16_224").eval(), \
        torch.randn(2, 3, 224, 224), None
    cfg = tf.BertConfig(num_hidden_layers=4)  # bert-base's widths (768, 12 heads, vocab 30522), 4 layers
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    yield "HF BERT (bert-base widths, 4 layers)", tf.BertModel(cfg).eval(), ids, "last_hidden_state"


def main():
    import onnxruntime as ort
    warnings.simplefilter("ignore")
    failures = []
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}")
    print(f"{'model':40} {'ort error':>10} {'autocast':>10} {'file bytes':>11} {'convert+export s':>17}")
    for name, model, x, field in models():
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            gm = autocastfx.convert(model, (x,))
            autocastfx.export(gm, os.path.join(d, "m.onnx"), (x,))
            seconds = time.perf_counter() - t
            torch.onnx.export(model, (x,), os.path.join(d, "f32.onnx"), dynamo=True, verbose=False)
            s = ort.InferenceSession(os.path.join(d, "m.onnx"), providers=["CPUExecutionProvider"])
            got = s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]
            with torch.no_grad():
                ref = model(x)
                ref = getattr(ref, field) if field else ref
                with torch.autocast("cpu", dtype=torch.float16):
                    ac = model(x)
                    ac = getattr(ac, field) if field else ac
            err, err_ac = rel(got, ref), rel(ac.float(), ref)
            ratio = size(os.path.join(d, "m.onnx")) / size(os.path.join(d, "f32.onnx"))
            print(f"{name:40} {err:10.2e} {err_ac:10.2e} {ratio:10.3f}x {seconds:17.1f}")
            if not (err <= max(2 * err_ac, 2e-3) and ratio <= 0.55):
                failures.append(name)
    if failures:
        print("FAILED:", ", ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
