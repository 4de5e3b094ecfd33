"""Progress that reads well in a log file: a live bar on a terminal, ten plain lines an epoch off one."""

from __future__ import annotations

from tqdm.auto import tqdm

from cifar_accel.progress import LineProgress, progress

from conftest import tiny_args


def test_off_a_terminal_each_tenth_of_the_work_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert list(progress(range(95), desc="epoch 1/3")) == list(range(95))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and "\r" not in "".join(lines)
    assert lines[0].startswith("epoch 1/3: 10/95 batches (10%), ") and lines[-1].startswith(
        "epoch 1/3: 95/95 batches (100%)"
    )
    decoding = progress(total=7, desc="decoding train", unit=" images")
    for _ in range(7):
        decoding.update(1)
    assert len(capsys.readouterr().out.splitlines()) == 7  # fewer steps than tenths: one line each


def test_a_terminal_gets_the_live_bar_and_other_processes_nothing(monkeypatch, capsys):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    bar = progress(range(5), desc="epoch 1/1")
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    assert isinstance(progress(range(5), desc="x"), tqdm) and progress(range(5), desc="x", show=False).disable
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert progress(range(5), desc="x").disable
    assert not isinstance(progress(range(5), desc="x"), LineProgress)


def test_a_training_log_holds_ten_lines_an_epoch_and_no_carriage_return(tiny_dataset, train_here, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    epochs = 2
    proc = train_here(tiny_args(tiny_dataset, tmp_path / "run", "--num_train_epochs", str(epochs)))
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout
    for epoch in range(1, epochs + 1):  # 9 batches an epoch: fewer than ten, so one line each
        lines = [line for line in proc.stdout.splitlines() if line.startswith(f"epoch {epoch}/{epochs}: ")]
        assert [line.split(" (")[0] for line in lines if "batches" in line] == [
            f"epoch {epoch}/{epochs}: {n}/9 batches" for n in range(1, 10)
        ]
