"""TensorFlow's own log lines, told from the program's (graphdist._tflog), on lines captured from
TensorFlow 2.21 here (a CPU machine: `graphdist run` of the seeds' MWMS example, `graphdist demo`,
a compat.v1 script), and the console of `graphdist run` without them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from graphdist._distribute.events import ConsoleLines, Event, render
from graphdist._exceptions import ArgumentError
from graphdist._tflog import TF_LOGS_ENV, is_tf_log, tf_logs_live

# captured: `graphdist run --workers 2 --output-format jsonl -- python
# examples/seed_mwms_training.py` (worker-0's lines, in order) and a compat.v1 script
TF_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796229949.635495    5611 cudart_stub.cc:31] Could not find cuda drivers on your "
    "machine, GPU will not be used.",
    "I0000 00:00:1796229949.711157    5611 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with "
    "the appropriate compiler flags.",
    "E0000 00:00:1796229955.417774    5611 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1796229955.426156    5611 coordination_service.cc:221] Initializing "
    "CoordinationService",
    "I0000 00:00:1796229955.428773    5611 grpc_server_lib.cc:467] Started server with target: "
    "grpc://localhost:10884",
    "I0000 00:00:1796229955.629681    5704 coordination_service.h:529] "
    "/job:worker/replica:0/task:1 has connected to coordination service. Incarnation: "
    "144535290754449659",
    "W0000 00:00:1796229958.224799    5611 dataset.cc:997] Input of GeneratorDatasetOp::Dataset "
    "will not be optimized because the dataset does not implement the AsGraphDefInternal() "
    "method needed to apply optimizations.",
    # TensorFlow's own format before absl (TF <= 2.15): the oneDNN notice
    "2023-11-20 10:01:02.123456: I tensorflow/core/util/port.cc:113] oneDNN custom operations are "
    "on. You may see slightly different numerical results due to floating-point round-off errors "
    "from different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "WARNING:tensorflow:From /work/main/.venv/lib/python3.11/site-packages/tensorflow/python/"
    "compat/v2_compat.py:98: disable_resource_variables (from "
    "tensorflow.python.ops.resource_variables_toggle) is deprecated and will be removed in a "
    "future version.",
    "/usr/lib/python3/dist-packages/tensorflow/python/util/dispatch.py:1260: UserWarning: "
    "something in TensorFlow",
]

# the example's own lines from the same run, and lines a user's program may well print
USER_LINES = [
    "data: scikit-learn digits, 1437 training images",
    "Number of devices: 2",
    "epoch 1/3 done, loss 1.9468",
    "held-out accuracy 0.911",
    "",
    "/job:worker/replica:0/task:1",  # alone, not after TensorFlow's "stragglers:"
    "Instructions for updating:",  # not after a TensorFlow warning
    "WARNING: my own warning",
    "WARNING:root:my own logging",
    "I1202 16:45:00.123456 140001 train.py:12] my absl.logging line",  # absl in Python: the user's
    "/home/me/train.py:12: UserWarning: my own warning",
    "E0000 is my error code",
    "  indented output of mine",
    "To enable the following instructions, read the manual",
]


@pytest.mark.parametrize("line", TF_LINES)
def test_tensorflows_lines_are_told(line):
    assert is_tf_log(line)


@pytest.mark.parametrize("line", USER_LINES)
def test_the_programs_own_lines_are_kept(line):
    assert not is_tf_log(line)
    assert not is_tf_log(line, ["epoch 1/3 done, loss 1.9468"])


def test_continuation_lines_follow_the_line_they_continue():
    stragglers = (
        "I0000 00:00:1796229955.439681    5701 coordination_service.cc:505] Example stragglers:"
    )
    assert is_tf_log("/job:worker/replica:0/task:1", [stragglers])
    assert is_tf_log("/job:worker/replica:0/task:2", [stragglers, "/job:worker/replica:0/task:1"])
    deprecated = TF_LINES[10]
    assert is_tf_log("Instructions for updating:", [deprecated])
    assert is_tf_log(
        "non-resource variables are not supported in the long term",
        [deprecated, "Instructions for updating:"],
    )
    assert not is_tf_log("epoch 1", [deprecated, "Instructions for updating:", "non-resource..."])
    warned = TF_LINES[11]
    assert is_tf_log("  return dispatch_target(*args, **kwargs)", [warned])
    assert not is_tf_log("  my own indented line", ["my line"])


def _line(text: str, task: str = "worker-0") -> Event:
    return Event("line", 1.0, 1, task, {"text": text})


def test_the_console_leaves_out_tensorflows_lines_unless_asked(monkeypatch):
    monkeypatch.delenv(TF_LOGS_ENV, raising=False)
    events = [_line(t) for t in TF_LINES]
    assert [render(e, events[:i]) for i, e in enumerate(events)] == [None] * len(TF_LINES)
    assert render(_line("epoch 1/3 done"), events) == "[worker-0] epoch 1/3 done"
    monkeypatch.setenv(TF_LOGS_ENV, "1")
    assert render(events[1], events[:1]) == f"[worker-0] {TF_LINES[1]}"


def test_the_consoles_lines_as_they_come(monkeypatch):
    monkeypatch.delenv(TF_LOGS_ENV, raising=False)
    console = ConsoleLines()
    stragglers = "I0000 00:00:1796229955.439681    5701 coordination_service.cc:505] stragglers:"
    shown = [
        console.render("worker-0", stragglers),
        console.render("worker-1", "/job:worker/replica:0/task:1"),  # another task's: kept
        console.render("worker-0", "/job:worker/replica:0/task:1"),  # the list continued
        *(console.render("worker-0", f"epoch {i}") for i in range(20)),
    ]
    assert shown[:4] == [
        None,
        "[worker-1] /job:worker/replica:0/task:1",
        None,
        "[worker-0] epoch 0",
    ]
    assert console.render("worker-0", TF_LINES[0]) is None


def test_the_switch_takes_1_or_0():
    assert tf_logs_live({TF_LOGS_ENV: "1"}) and not tf_logs_live({TF_LOGS_ENV: "0"})
    assert not tf_logs_live({}) and not tf_logs_live({TF_LOGS_ENV: ""})
    with pytest.raises(ArgumentError, match=r"GRAPHDIST_TF_LOGS must be 1 .* not 'yes'"):
        tf_logs_live({TF_LOGS_ENV: "yes"})
    assert not tf_logs_live({TF_LOGS_ENV: "yes"}, check=False)


SCRIPT = """
import os, subprocess, sys, threading
from graphdist._tflog import import_tensorflow_quietly
print("before", file=sys.stderr, flush=True)
def mine():
    os.write(2, b"a line of another thread\\n")
threading.Thread(target=mine).start()
child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.5); "
                          "print('the child', file=sys.stderr)"])
tf = import_tensorflow_quietly()
child.wait()
print("after", tf.__name__, file=sys.stderr, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("live", ["", "1"])
def test_import_tensorflow_quietly_keeps_only_the_programs_lines(live):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env[TF_LOGS_ENV] = live
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=100
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 0, result.stderr
    assert lines[0] == "before" and lines[-1] == "after tensorflow"
    assert "a line of another thread" in lines and "the child" in lines
    tf_lines = [line for line in lines if is_tf_log(line)]
    if live:
        assert tf_lines  # the switch shows them live
    else:
        assert tf_lines == [], lines


def test_a_multi_line_status_after_a_cpp_line_is_tensorflows():
    """A collective aborted by a peer's death: TensorFlow's C++ line, then its status's lines
    (gRPC's detail, the hint, the op), which are no line of the program's."""
    aborted = (
        "E0000 00:00:1796575870.707048   22274 ring_alg.cc:291] Aborting RingReduce with "
        "UNAVAILABLE: recvmsg:Connection reset by peer"
    )
    detail = (
        "Additional GRPC error information from remote target /job:worker/replica:0/task:1 "
        "while calling /tensorflow.WorkerService/RecvBuf:"
    )
    peer = ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"reset"}'
    hint = "The error could be from a previous operation. Restart your program to reset."
    node = "\t [[{{node div_no_nan/CollectiveReduceV2}}]] [type.googleapis.com/tensorflow.X='']"
    assert is_tf_log(detail, [aborted])
    assert is_tf_log(peer, [aborted, detail])
    assert is_tf_log(hint, [aborted, detail, peer])
    assert is_tf_log(node, [aborted, detail, peer, hint])
    # the same text in the program's own traceback (its exception's message) is the program's
    assert not is_tf_log(detail, ["Traceback (most recent call last):"])
    assert not is_tf_log(hint, ['  File "train.py", line 3, in <module>'])
