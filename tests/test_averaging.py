"""The exponential moving average of the weights: its formula, its checkpoint file, an exact resume."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cifar_accel.averaging import EMA_FILE, WeightAverage, ema_decay_at
from cifar_accel.inference import load_model
from cifar_accel.outputs import complete_checkpoints

from conftest import assert_same_run, crashed_copy, read_results, tiny_args


def test_the_average_follows_its_formula_with_the_decay_warming_up():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = WeightAverage(model, decay=0.5)
    expected = None
    for step in range(5):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        model(torch.randn(4, 3))  # moves the BatchNorm statistics and its batch counter
        weights = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        if expected is None:
            expected = weights  # the first update copies
        else:
            decay = ema_decay_at(0.5, step - 1)  # 0.1, 0.18, 0.25, then 0.5 at most
            expected = [e + (w - e) * (1 - decay) if w.is_floating_point() else w for e, w in
                        zip(expected, weights, strict=True)]  # fmt: skip
        ema.update(model)
    averaged = [*ema.module.parameters(), *ema.module.buffers()]
    for got, want in zip(averaged, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert [ema_decay_at(0.5, n) for n in (0, 1, 2, 8, 100)] == pytest.approx([0.1, 2 / 11, 0.25, 0.5, 0.5])
    assert int(ema.n_averaged) == ema.updates == 5
    copy = WeightAverage(model, decay=0.5)
    copy.load_state_dict(ema.state_dict())  # as a resume does: the host's count comes from the saved one
    assert copy.updates == 5


def ema_args(dataset, out, *extra):
    return tiny_args(dataset, out, "--num_train_epochs", "3", "--ema_decay", "0.9", "--checkpointing_steps", "4",
                     "--checkpoints_total_limit", "100", "--max_eval_samples", "40", *extra)  # fmt: skip


def test_an_averaged_run_exports_the_average_and_resumes_bitwise(tiny_dataset, train_here, tmp_path):
    straight = tmp_path / "straight"
    proc = train_here(ema_args(tiny_dataset, straight))
    assert proc.returncode == 0, proc.stderr
    results = read_results(straight)
    best = straight / "checkpoints" / f"step_{9 * results['best_epoch']:08d}"
    average = load_file(best / EMA_FILE)
    exported = load_file(straight / "model.safetensors")
    assert int(average.pop("n_averaged")) == 9 * results["best_epoch"]  # one update per optimizer step
    assert exported.keys() == {name.removeprefix("module.") for name in average}
    assert all(torch.equal(exported[name.removeprefix("module.")], t) for name, t in average.items())
    trained = load_file(best / "model.safetensors")  # the weights being trained differ from their average
    assert not torch.equal(trained["classifier.weight"], exported["classifier.weight"])
    # The average's own file loads as the checkpoint does: the validated weights, not AveragedModel's keys.
    from_file = load_model(best / EMA_FILE).model.state_dict()
    assert all(torch.equal(from_file[name], exported[name]) for name in exported)

    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=20)  # 2 batches into epoch 3
    proc = train_here([*ema_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert_same_run(straight, resumed)

    newest = complete_checkpoints(resumed)[-1]
    (newest / EMA_FILE).unlink()
    proc = train_here([*ema_args(tiny_dataset, resumed), "--resume", str(newest)])
    assert proc.returncode == 2 and f"is incomplete: {EMA_FILE} is missing" in proc.stderr
