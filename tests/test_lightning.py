"""Lightning: the precision plugin trains through autocastfx's step, against the same Trainer in float32:
accumulation (with a short last window each epoch), clipping, a per-update scheduler, validation in eval mode,
checkpoint and resume, logging at the logging interval, and the refusals."""
import csv
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import AtenRecorder

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autocastfx  # noqa: E402
from autocastfx.integrations.lightning import MixedPrecision  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Lit(L.LightningModule):
    """A classifier as one would write it for float32: the network at self.model, the loss in training_step."""

    def __init__(self, dropout=0.0, lr=1e-2):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10))
        self.lr = lr
        self.losses, self.val_modes = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_modes.append(self.model.training)
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _trainer(out, epochs, plugin=True, **kw):
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "log_every_n_steps": 2, **kw}
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, default_root_dir=str(out),
                     plugins=[MixedPrecision()] if plugin else None, logger=CSVLogger(str(out)),
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def _fit(out, epochs=3, plugin=True, dropout=0.0, ckpt_path=None, **kw):
    torch.manual_seed(0)
    lit = Lit(dropout)
    trainer = _trainer(out, epochs, plugin, **kw)
    # 7 batches an epoch: with accumulate_grad_batches=2, updates of 2, 2, 2 and 1 batches
    trainer.fit(lit, DataLoader(_data(56, 1), batch_size=8), DataLoader(_data(16, 2), batch_size=8),
                ckpt_path=ckpt_path)
    return lit, trainer


def _rows(trainer):
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_fit_matches_float32_with_accumulation_clipping_schedule_and_validation(tmp_path, monkeypatch):
    reads = []
    summary = autocastfx.StepStats.summary
    monkeypatch.setattr(autocastfx.StepStats, "summary", lambda s: reads.append(1) or summary(s))
    ours, trainer = _fit(tmp_path / "ours")
    ref, _ = _fit(tmp_path / "ref", plugin=False)
    reads_in_fit = len(reads)

    assert len(ours.losses) == len(ref.losses) == 21  # 3 epochs of 7 batches
    worst = max(abs(a - b) for a, b in zip(ours.losses, ref.losses))
    print(f"Lightning: largest loss difference to float32 over {len(ours.losses)} steps: {worst:.2e}")
    assert worst < 1e-3  # float16 noise on a loss near 2.3 (measured: 3.5e-4)
    assert ours.val_modes == ref.val_modes and not any(ours.val_modes)  # sanity check + 3 epochs, all in eval

    step = trainer.precision_plugin.step
    assert step.accum_steps == 2 and step.clip == 0.5 and step.micro == 24  # 12 whole windows
    s = step.stats.summary()
    assert s["steps"] == 12 and trainer.global_step == 12  # 4 updates an epoch, the short window included
    real = trainer.optimizers[0]
    assert real.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.8 ** 12)  # the scheduler drives the updates
    ref_params = dict(ref.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in ours.model.parameters())  # the float32 weights AdamW stepped
    diffs = [(p - ref_params[n]).abs() for n, p in ours.model.named_parameters()]
    assert len(diffs) == len(ref_params) == 4
    mean = torch.cat([d.flatten() for d in diffs]).mean()
    print(f"weights: largest difference {max(d.max() for d in diffs):.1e}, mean {mean:.1e}")
    assert all(d.max() < 1e-2 and d.mean() < 1e-4 for d in diffs)  # AdamW moves a weight by up to lr=1e-2 a step

    rows = [r for r in _rows(trainer) if r.get("loss_scale")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5, 7, 9, 11]  # every log_every_n_steps=2 updates, no more
    assert reads_in_fit == len(rows)  # the device values read at those intervals only
    assert all(float(r["loss_scale"]) >= 1 and float(r["skipped_steps"]) == 0 for r in rows)
    assert all(0 < float(r["grad_norm"]) for r in rows)
    assert [float(r["loss_scale"]) for r in rows][-1] == s["scale"]


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    whole, _ = _fit(tmp_path / "whole", 3, dropout=0.25)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _fit(tmp_path / "part", 2, dropout=0.25, callbacks=[ckpt])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert state["MixedPrecision"]["micro"] == 16 and "scaler" in state["MixedPrecision"]
    # the checkpoint's weights are the converted module's float32 parameters: they load into the LightningModule
    # as written
    plain = Lit(0.25)
    plain.load_state_dict(state["state_dict"])
    assert all(p.dtype == torch.float32 for p in plain.parameters())

    resumed, trainer = _fit(tmp_path / "part", 3, dropout=0.25, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.losses == whole.losses[14:]  # the last epoch, dropout masks and all
    for a, b in zip(autocastfx.master_parameters(whole.model), autocastfx.master_parameters(resumed.model)):
        assert torch.equal(a, b)
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    assert trainer.precision_plugin.step.stats.summary()["steps"] == 12


def test_validate_runs_the_converted_module_in_eval_mode(tmp_path):
    lit, trainer = _fit(tmp_path, 1, dropout=0.5)
    val = DataLoader(_data(16, 2), batch_size=8)
    lit.val_modes.clear()
    first = trainer.validate(lit, val, verbose=False)
    second = trainer.validate(lit, val, verbose=False)
    assert first == second and lit.val_modes == [False] * 4
    assert lit.model.meta["autocastfx"] is not None and lit.model.training  # back in training mode after

    # validate alone: the plugin converts on the first (inference-mode) call
    torch.manual_seed(0)
    fresh = Lit(0.5)
    v = L.Trainer(accelerator="cpu", devices=1, plugins=[MixedPrecision()], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    a, b = v.validate(fresh, val, verbose=False), v.validate(fresh, val, verbose=False)
    assert a == b and "autocastfx" in fresh.model.meta and not any(fresh.val_modes)


def test_training_forward_runs_its_matmuls_in_float16(tmp_path):
    with AtenRecorder() as rec:
        _fit(tmp_path, 1)
    mms = rec.ops("mm", "addmm")
    assert mms and sum(torch.float16 in c.in_dtypes for c in mms) > len(mms) // 2


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 10)
        self.b.weight = self.a.weight  # one weight, two names: the converted module keeps one

    def forward(self, x):
        return self.head(F.relu(self.b(F.relu(self.a(x)))))


class Tied(Lit):
    def __init__(self):
        super().__init__()
        self.model = TiedNet()


def test_checkpoints_hold_the_models_float32_weights_and_load_both_ways(tmp_path):
    torch.manual_seed(0)
    lit = Tied()
    trainer = _trainer(tmp_path, 1, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)])
    val = DataLoader(_data(16, 2), batch_size=8)
    trainer.fit(lit, DataLoader(_data(32, 1), batch_size=8), val)
    path = str(tmp_path / "ckpt" / "last.ckpt")
    weights = torch.load(path, weights_only=False)["state_dict"]
    assert "autocastfx" in lit.model.meta
    w = lit.model.get_parameter("a.weight")  # the model's own tensor, trained in place
    assert w.dtype == torch.float32 and w is lit.model.state_dict(keep_vars=True)["b.weight"]  # both names
    assert torch.equal(weights["model.a.weight"], w)
    assert torch.equal(weights["model.b.weight"], w)  # under both names
    assert all(torch.equal(weights["model." + n], p) for n, p in lit.model.named_parameters())

    plain = Tied()
    plain.load_state_dict(weights)  # strict: the unconverted module, float32
    assert torch.equal(plain.model.b.weight, w) and plain.model.a.weight is plain.model.b.weight
    before = {n: p.detach().clone() for n, p in lit.model.named_parameters()}
    with torch.no_grad():
        for p in lit.model.parameters():
            p.zero_()
    assert trainer.validate(lit, val, ckpt_path=path, verbose=False)  # into the converted module
    after = dict(lit.model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before)  # its weights set from the checkpoint
    tied = lit.model.state_dict(keep_vars=True)
    assert tied["a.weight"] is tied["b.weight"] is lit.model.get_parameter("a.weight")  # still one tensor
    resumed = Tied()
    _trainer(tmp_path / "resumed", 2).fit(resumed, DataLoader(_data(32, 1), batch_size=8), val, ckpt_path=path)
    assert len(resumed.losses) == 4


class Manual(Lit):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class TwoNets(Lit):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(10, 10)


def _refused(tmp_path, lit, match, exc=ValueError, **kw):
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        **{"plugins": [MixedPrecision()], **kw})
    with pytest.raises(exc, match=match):
        trainer.fit(lit, DataLoader(_data(16, 1), batch_size=8))


def test_refusals_name_the_fix(tmp_path):
    import autocastfx.lightning
    assert autocastfx.lightning.MixedPrecision is MixedPrecision  # the short name
    with pytest.raises(ValueError, match="autocastfx.integrations.lightning.MixedPrecision"):
        L.Trainer(precision="16-mixed", plugins=[MixedPrecision()])  # Lightning's own check, naming the plugin
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        MixedPrecision(dtype=torch.float32)
    _refused(tmp_path, Manual(), "manual optimization")
    _refused(tmp_path, Lit(), "gradient_clip_algorithm='norm'", gradient_clip_val=1.0, gradient_clip_algorithm="value")
    _refused(tmp_path, TwoNets(), r"attribute='\.\.\.'")
    _refused(tmp_path, Lit(), "is not a module", plugins=[MixedPrecision(attribute="lr")])


class Checked(Lit):
    def on_train_start(self):
        self.converted_at_start = "autocastfx" in getattr(self.model, "meta", {})


def test_example_input_converts_at_setup_and_uneven_accumulation(tmp_path):
    lit = Checked()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=3,
                        plugins=[MixedPrecision(example_input=lambda module: torch.zeros(8, 32))])
    trainer.fit(lit, DataLoader(_data(56, 1), batch_size=8))
    assert lit.converted_at_start
    step = trainer.precision_plugin.step
    assert step.stats.summary()["steps"] == trainer.global_step == 6  # windows of 3, 3 and 1 batches an epoch


class Skips(Lit):
    """Skips a batch by returning None, as Lightning documents: here the last of every window of two."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 == 1 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("case", ["accumulation_scheduler", "skipped_batch"])
def test_lightnings_own_window_changes_are_followed(tmp_path, case):
    """A GradientAccumulationScheduler (1 batch a window, then 4) was read once, when the step was built: twice the
    updates, each of a quarter of the loss (weights 0.21 off float32, bf16-mixed 0.012). A training_step returning
    None at a window's end left the window's gradients to the next window (0.40 off, bf16-mixed 0.009)."""
    def fit(plugin):
        torch.manual_seed(0)
        lit = Skips() if case == "skipped_batch" else Lit()
        kw = {"gradient_clip_val": None, "log_every_n_steps": 50}
        if case == "accumulation_scheduler":
            from lightning.pytorch.callbacks import GradientAccumulationScheduler
            kw.update(accumulate_grad_batches=1, callbacks=[GradientAccumulationScheduler({0: 1, 1: 4})])
        trainer = _trainer(tmp_path / str(plugin), 3, plugin, **kw)
        trainer.fit(lit, DataLoader(_data(64, 1), batch_size=8))
        return torch.cat([p.detach().flatten() for p in lit.parameters()])

    want, got = fit(False), fit(True)
    assert ((got - want).norm() / want.norm()).item() < 0.05


class LitWeighted(Lit):
    """A parameter of the LightningModule outside the network: a learned loss weighting (uncertainty weighting)."""

    def __init__(self):
        super().__init__(lr=5e-2)
        self.log_var = nn.Parameter(torch.tensor(0.5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y) * torch.exp(-self.log_var) + self.log_var
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_a_parameter_of_the_module_outside_the_network_trains_as_in_float32(tmp_path):
    """The step trains a LightningModule's own parameter that the loss reads (not the network's) in float32,
    unscaled with the rest: its path tracks the float32 Trainer's."""
    runs = []
    for plugin in (True, False):
        torch.manual_seed(0)
        lit = LitWeighted()
        trainer = _trainer(tmp_path / str(plugin), 2, plugin, accumulate_grad_batches=1, gradient_clip_val=None)
        trainer.fit(lit, DataLoader(_data(56, 1), batch_size=8))
        runs.append(lit)
    ours, ref = runs
    print(f"log_var: {float(ours.log_var):.5f} against float32 {float(ref.log_var):.5f}, from 0.5")
    assert ours.log_var.dtype == torch.float32 and abs(float(ref.log_var) - 0.5) > 0.05  # it moved
    assert abs(float(ours.log_var) - float(ref.log_var)) < 1e-3, (float(ours.log_var), float(ref.log_var))
    assert max(abs(a - b) for a, b in zip(ours.losses, ref.losses)) < 5e-3
