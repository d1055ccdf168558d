"""Convert every torchvision classification model and a set of timm convnets and ViTs (random weights).

Run in an environment with torchvision and timm installed (see docs/realmodels.md):
    python tests/realmodels/check_vision.py [--quick] [--timm]
Each model is converted with the defaults and its eval output compared with the float32 model and with
torch.autocast; the script fails on any capture error, unclassified op, or output error over limits.
"""
import argparse
import sys
import time
import traceback
import warnings

import torch

import autocastfx


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _no_zero_heads(m):
    """A classifier whose weights start at zero (torchvision's ViTs, timm's mixer) makes every output zero, which
    compares nothing: such a layer's weights get small random values (std 0.02) first."""
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and not mod.weight.any():
                mod.weight.normal_(0, 0.02)


def check(name, build, size):
    torch.manual_seed(0)
    m = build().eval()
    _no_zero_heads(m)
    x = torch.randn(1, 3, size, size)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unclassified ops are checked through the report below
        gm = autocastfx.convert(m, (x,))
    dt = time.perf_counter() - t
    with torch.no_grad():
        ref = m(x)
        out = gm(x)
        with torch.autocast("cpu", dtype=torch.float16):
            ac = m(x)
    rep = autocastfx.report(gm).totals
    if not torch.isfinite(ref).all():
        print(f"skip {name}: the float32 model's own output is not finite at random init")
        return True
    if not ref.any():
        print(f"FAIL {name}: the float32 model's output is all zeros: the comparison would measure nothing")
        return False
    err, err_ac = rel(out, ref), rel(ac, ref)
    if not torch.isfinite(ac).all() and torch.isfinite(out).all() and err < 2e-3:
        print(f"ok   {name}: finite, error {err:.1e}; torch.autocast overflows to inf/nan here")
        return True
    if not torch.isfinite(ac).all() and not torch.isfinite(out).all():
        print(f"note {name}: float16 overflows at random init, under torch.autocast as well (try bfloat16)")
        return True
    ok = torch.isfinite(out).all().item() and not rep["unclassified"] and err < max(2 * err_ac, 2e-3)
    print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {rep['capture']:15s} {dt:5.1f}s nodes/dtype {rep['nodes_per_dtype']} "
          f"casts {rep['casts']}/{rep['casts_naive']} err {err:.1e} autocast {err_ac:.1e} "
          f"unclassified {rep['unclassified']}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small subset")
    ap.add_argument("--timm", action="store_true", help="timm models instead of torchvision")
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    failures = []
    if a.timm:
        import timm
        names = ["resnet18", "resnet50", "efficientnet_b0", "mobilenetv3_small_100", "convnext_tiny", "regnetx_002",
                 "densenet121", "vit_tiny_patch16_224", "vit_small_patch16_224", "deit_tiny_patch16_224",
                 "swin_tiny_patch4_window7_224", "mixer_b16_224", "cait_xxs24_224", "levit_128s"]
        models = [(n, (lambda n=n: timm.create_model(n, pretrained=False)), 224) for n in names]
    else:
        import torchvision
        names = torchvision.models.list_models(module=torchvision.models)
        models = [(n, (lambda n=n: torchvision.models.get_model(n, weights=None)),
                   299 if n == "inception_v3" else 224) for n in names]
    if a.quick:
        models = models[:6]
    if a.only:
        models = [m for m in models if m[0] == a.only]
    for name, build, size in models:
        try:
            if not check(name, build, size):
                failures.append(name)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)
            failures.append(name)
    print(f"{len(models) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
