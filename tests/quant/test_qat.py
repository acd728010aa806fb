"""QAT: the clipped straight-through estimator's gradient, and a short run that lowers the loss."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tessel import LLM
from tessel.cli import app
from tessel.errors import TesselError
from tessel.models.quantized.qparams import QuantRange
from tessel.quant.qat import QATOptions, fake_quantize, train_qat


@pytest.mark.parametrize("qrange", [QuantRange(8), QuantRange(4)], ids=str)
def test_ste_gradient_is_one_inside_the_clip_range_and_zero_outside(qrange: QuantRange) -> None:
    s = 1.2 / qrange.qmax  # clip range +-1.2
    scale = torch.tensor(s)
    x = torch.linspace(-2, 2, 401, dtype=torch.float32).requires_grad_(True)
    y = fake_quantize(x, scale, qrange)
    y.backward(torch.ones_like(y))
    inside = (x.detach() / scale >= qrange.qmin) & (x.detach() / scale <= qrange.qmax)
    a = x.detach().abs()
    assert torch.all(inside[a < 1.19]) and not torch.any(inside[a > 1.21])
    assert torch.all(x.grad[inside] == 1) and torch.all(x.grad[~inside] == 0)
    assert (~inside).any() and inside.any()
    expected = torch.clamp(torch.round(x.detach() / scale), qrange.qmin, qrange.qmax) * scale
    assert torch.equal(y.detach(), expected)


def test_ste_passes_upstream_gradients_through() -> None:
    x = torch.tensor([0.05, 0.3, 5.0], requires_grad=True)
    fake_quantize(x, torch.tensor(0.01), QuantRange(8)).backward(torch.tensor([2.0, -3.0, 7.0]))
    assert x.grad.tolist() == [2.0, -3.0, 0.0]


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8"])
def test_a_short_run_lowers_the_loss_and_writes_a_loadable_checkpoint(
    tiny_llama, calib_text, tmp_path, scheme
):
    group = 32 if scheme == "w4a16" else None
    options = QATOptions(scheme, calib_text, steps=12, lr=3e-3, seq_len=32, batch_size=4, group_size=group)
    result = train_qat(tiny_llama, tmp_path / scheme, options)
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first, result.losses
    config = json.loads((tmp_path / scheme / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    LLM(tmp_path / scheme, max_model_len=64).generate(["Hello"])


def test_cli_qat_runs_and_rejects_a_short_text(tiny_llama, calib_text, tmp_path) -> None:
    args = ["qat", str(tiny_llama), "--out", str(tmp_path / "o"), "--train", str(calib_text)]
    result = CliRunner().invoke(app, [*args, "--steps", "2", "--seq-len", "16", "--group-size", "32"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "loss" in result.output
    result = CliRunner().invoke(app, [*args, "--overwrite", "--seq-len", "100000", "--group-size", "32"])
    assert isinstance(result.exception, TesselError) and "--batch-size" in str(result.exception)


def test_a_loss_that_turns_non_finite_stops_with_exit_2_and_writes_nothing(
    tiny_llama, calib_text, tmp_path, monkeypatch
) -> None:
    real_step = torch.optim.AdamW.step

    def blown_up_step(self, *args, **kwargs):  # noqa: ANN001, ANN202 - what a far too large lr does
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            for param in self.param_groups[0]["params"]:
                param.fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blown_up_step)
    out = tmp_path / "o"
    args = ["qat", str(tiny_llama), "--out", str(out), "--train", str(calib_text)]
    result = CliRunner().invoke(app, [*args, "--steps", "4", "--seq-len", "16", "--group-size", "32"])
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2, result.output
    message = str(result.exception)
    assert "diverged at step" in message and "of 4" in message and "smaller --lr" in message
    assert "\n" not in message and not out.exists() and list(tmp_path.iterdir()) == []


def test_weights_that_turn_non_finite_at_the_last_step_are_not_written(
    tiny_llama, calib_text, tmp_path, monkeypatch
) -> None:
    real_step = torch.optim.AdamW.step

    def poisoned_step(self, *args, **kwargs):  # noqa: ANN001, ANN202
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    options = QATOptions("w4a16", calib_text, steps=1, lr=1e-5, seq_len=16, batch_size=1, group_size=32)
    with pytest.raises(TesselError, match="diverged at step 1 of 1: the weights are not finite"):
        train_qat(tiny_llama, tmp_path / "o", options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), 0.0, -1.0, 1e-12, 1e300])
def test_a_learning_rate_out_of_range_is_refused(calib_text, lr) -> None:
    with pytest.raises(TesselError, match="--lr"):
        QATOptions("w4a16", calib_text, lr=lr)


@pytest.mark.parametrize("kind", ["binary", "empty", "directory"])
def test_a_bad_train_file_names_train(tiny_llama, tmp_path, kind) -> None:
    train = tmp_path / "bin.dat"
    if kind == "directory":
        train.mkdir()
    else:
        train.write_bytes(bytes(range(256)) if kind == "binary" else b"")
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["qat", str(tiny_llama), "--out", str(out), "--train", str(train)])
    assert isinstance(result.exception, TesselError), result.output
    assert "--train" in str(result.exception) and "--calib" not in str(result.exception)
    assert not out.exists()
    with pytest.raises(TesselError, match="--train"):  # the library says the same
        train_qat(tiny_llama, out, QATOptions("w4a16", train, group_size=32))


def test_qat_overwrite_replaces_only_its_own_output(tiny_llama, calib_text, tmp_path) -> None:
    out = tmp_path / "o"
    args = ["qat", str(tiny_llama), "--out", str(out), "--train", str(calib_text)]
    args += ["--steps", "1", "--seq-len", "16", "--group-size", "32"]
    assert CliRunner().invoke(app, args).exit_code == 0
    again = CliRunner().invoke(app, args)
    assert isinstance(again.exception, TesselError) and "--overwrite" in str(again.exception)
    result = CliRunner().invoke(app, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and (out / "config.json").is_file()
