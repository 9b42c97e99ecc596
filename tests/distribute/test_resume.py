"""Resume helpers: a training killed after its second epoch (or step 5) resumes from its backup.

Each training runs in a process of its own (tf-keras needs TF_USE_LEGACY_KERAS before TensorFlow
is imported, and a kill must be a real SIGKILL), without TF_CONFIG: the process is the chief.
The script hangs once it has reported the epoch (or step) it was told to, so the kill always
lands after that point's backup and before the next one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import graphdist
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, run_python, wait_gone

RUN_TIMEOUT_S = 120  # one short training: a TensorFlow import and a few steps, on a loaded machine

SCRIPT = """
import hashlib, os, sys, time
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
import tensorflow as tf
import graphdist

mode, base, hang, freq = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tf.keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
y = x @ np.arange(6, dtype="float32").reshape(3, 2)
model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
optimizer = tf.keras.optimizers.Adam(0.01)


def stop_here(what):
    print(what, flush=True)
    if what.startswith(f"{hang}/") or what.startswith(f"epoch {hang}/"):
        print("hanging", flush=True)
        time.sleep(600)


if mode == "fit":
    model.compile(optimizer, "mse")
    backup = graphdist.backup_and_restore(base, save_freq=freq if freq == "epoch" else int(freq))
    print("resume_at", *backup.resume_at, flush=True)

    class Report(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("trained a step", flush=True)

        def on_epoch_end(self, epoch, logs=None):
            stop_here(f"epoch {epoch + 1}/3 done")

    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=[backup, Report()])
else:
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = graphdist.resume_checkpoint(checkpoint, base)
    print("resume_at", int(step.numpy()), flush=True)
    while int(step.numpy()) < 6:
        i = int(step.numpy()) % 4
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[4 * i : 4 * i + 4]) - y[4 * i : 4 * i + 4]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        step.assign_add(1)
        if int(step.numpy()) % 2 == 0:
            manager.save()
        print("trained a step", flush=True)
        stop_here(f"{int(step.numpy())}/6 done")
digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
print("weights", digest, flush=True)
"""


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return str(path)


def train(script: str, mode: str, base: Path, freq: str = "epoch") -> list[str]:
    """One whole training; its stdout lines."""
    result = run_python([script, mode, str(base), "0", freq], timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def train_until_killed(script: str, mode: str, base: Path, hang: int, freq: str = "epoch"):
    """A training SIGKILLed once it reported ``hang`` (an epoch, or a step of the custom loop);
    its stdout lines. The process must be gone afterwards."""
    with open(base.parent / f"{base.name}.stderr", "w", encoding="utf-8") as err:
        proc = subprocess.Popen(
            [sys.executable, script, mode, str(base), str(hang), freq],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO,
            env={**os.environ, **QUIET_TF},
        )
        lines = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if lines[-1] == "hanging":
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=EVENTUALLY_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert lines[-1:] == ["hanging"], (lines, (base.parent / f"{base.name}.stderr").read_text())
    assert proc.returncode == -signal.SIGKILL
    assert wait_gone([proc.pid], EVENTUALLY_S) == []
    return lines


def resumed_lines(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("graphdist: resumed from ")]


def weights(lines: list[str]) -> str:
    return next(ln.split()[1] for ln in lines if ln.startswith("weights "))


@pytest.mark.integration
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_fit_backed_up_every_n_steps_resumes_mid_epoch(script, tmp_path):
    base = tmp_path / "backup"
    train_until_killed(script, "fit", base, hang=2, freq="3")  # backups after steps 3 and 6
    resumed = train(script, "fit", base, freq="3")
    assert "resume_at 1 2" in resumed  # epoch index 1 (the second), 2 of its 4 steps done
    assert resumed_lines(resumed) == [f"graphdist: resumed from {base} (after step 2 of epoch 2)"]
    assert [ln for ln in resumed if ln.startswith("epoch ")] == ["epoch 2/3 done", "epoch 3/3 done"]
    assert resumed.count("trained a step") == 2 + 4
    assert not base.exists()


@pytest.mark.integration
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_custom_loop_resumes_from_the_latest_checkpoint_and_keeps_them(script, tmp_path):
    base = tmp_path / "ckpt"
    killed = train_until_killed(script, "custom", base, hang=5)  # saved after steps 2 and 4
    assert killed.count("trained a step") == 5 and resumed_lines(killed) == []

    resumed = train(script, "custom", base)
    assert "resume_at 4" in resumed
    assert resumed_lines(resumed) == [f"graphdist: resumed from {base / 'ckpt-2'}"]
    assert resumed.count("trained a step") == 2
    # Kept after the run (they are the model), the newest max_to_keep=2 of them.
    assert sorted(n for n in os.listdir(base) if n.endswith(".index")) == [
        "ckpt-2.index",
        "ckpt-3.index",
    ]

    clean = train(script, "custom", tmp_path / "clean")
    assert resumed_lines(clean) == [] and clean.count("trained a step") == 6
    assert weights(resumed) == weights(clean)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"base_dir": ""}, "base_dir"),
        ({"base_dir": 3}, "base_dir"),
        ({"base_dir": b"/tmp/x"}, "base_dir"),
        ({"base_dir": "b", "save_freq": 0}, "save_freq"),
        ({"base_dir": "b", "save_freq": -5}, "save_freq"),
        ({"base_dir": "b", "save_freq": True}, "save_freq"),
        ({"base_dir": "b", "save_freq": 2.5}, "save_freq"),
        ({"base_dir": "b", "save_freq": "batch"}, "save_freq"),
        ({"base_dir": "b", "save_freq": None}, "save_freq"),
    ],
)
def test_backup_bad_arguments_are_argument_errors(kwargs, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = kwargs.pop("base_dir")
    with pytest.raises(graphdist.ArgumentError) as info:
        graphdist.backup_and_restore(base, **kwargs)
    assert info.value.name == name
    assert name in str(info.value)
    assert os.listdir(tmp_path) == []  # refused before anything was made


def test_checkpoint_bad_arguments_are_argument_errors(tmp_path):
    for base, keep in (("", 2), (None, 2), (str(tmp_path), 0), (str(tmp_path), 1.5)):
        with pytest.raises(graphdist.ArgumentError, match=r"base_dir|max_to_keep"):
            graphdist.resume_checkpoint(object(), base, max_to_keep=keep)  # type: ignore[arg-type]


CHECKS = """
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import types
import tensorflow as tf
import graphdist

try:
    graphdist.resume_checkpoint(tf.keras.Sequential(), sys.argv[1])
except graphdist.ArgumentError as exc:
    print("checkpoint:", exc.name, "tf.train.Checkpoint" in str(exc))

backup = graphdist.backup_and_restore(sys.argv[1], save_freq=5)
# Only the strategy's type matters here: tf-keras never backs up every N steps under PS.
ps = object.__new__(tf.distribute.ParameterServerStrategy)
backup.set_model(types.SimpleNamespace(distribute_strategy=ps))
try:
    backup.on_train_begin()
except graphdist.ArgumentError as exc:
    print("ps:", exc.name, exc.value, "save_freq='epoch'" in str(exc))
print("made:", os.path.exists(sys.argv[1]))
"""


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_non_checkpoint_and_steps_under_ps_are_refused(tmp_path):
    result = run_python(["-c", CHECKS, str(tmp_path / "b")], timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "checkpoint: checkpoint True",
        "ps: save_freq 5 True",
        "made: False",
    ]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_keras_3_is_refused_with_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    code = (
        "import graphdist\n"
        "try:\n"
        f"    graphdist.backup_and_restore({str(tmp_path / 'b')!r})\n"
        "except graphdist.UnsupportedVersionError as exc:\n"
        "    print('refused:', 'TF_USE_LEGACY_KERAS=1' in str(exc))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=REPO,
        env={**env, **QUIET_TF},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "refused: True"


def test_the_resume_line_is_what_the_launcher_looks_for():
    from graphdist._distribute import launcher, resume

    assert launcher.RESUMED_PREFIX is resume.RESUMED_PREFIX == "graphdist: resumed from "
