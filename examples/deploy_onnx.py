"""Ship a converted model to ONNX Runtime.

Converts a small convolutional network (batch norms, residual blocks) to float16, writes the deployment ONNX
file (batch norms folded into their convolutions, every weight float16), loads it in onnxruntime and compares it
with the float32 model and with torch.autocast.

    python examples/deploy_onnx.py [--out DIR]

For TensorRT, hand the same file to trtexec: trtexec --onnx=DIR/model.onnx --fp16 --saveEngine=model.plan
"""
import argparse
import os
import tempfile
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def build():
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         Block(64), Block(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def size(path):
    return os.path.getsize(path) + (os.path.getsize(path + ".data") if os.path.exists(path + ".data") else 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for model.onnx (default: a temporary folder)")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():  # statistics as a trained network has them, not the initial zeros and ones
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 32, 32)
    gm = autocastfx.convert(model, (x,))
    path = os.path.join(out, "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autocastfx.export(gm, path, (x,))  # loads the file in onnxruntime and checks it against the module
        torch.onnx.export(model, (x,), os.path.join(out, "float32.onnx"), dynamo=True, verbose=False)
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.float16):
            ac = model(x).float()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    err_ac = ((ac.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"wrote {path} ({size(path):,} bytes; float32 model {size(os.path.join(out, 'float32.onnx')):,})")
    print(f"onnxruntime {ort.__version__}: relative error against the float32 model {err:.2e} "
          f"(torch.autocast {err_ac:.2e})")
    print(f"TensorRT: trtexec --onnx={path} --fp16")
    return err, err_ac


if __name__ == "__main__":
    main()
