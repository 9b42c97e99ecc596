"""Ray Train's side of ``restart.py``'s ``warm-ray`` case: the same training task
(``_restart_task.py``, MultiWorkerMirroredStrategy, a backup every ``--save-every`` steps) run by
Ray Train's ``TensorflowTrainer`` on a Ray instance of its own on this machine, two workers,
``FailureConfig(max_failures=1)``: what a Ray user runs instead of ``graphdist run --backend
ray``. Each worker says ``rank R pid P`` before it runs the task (Ray prefixes every worker line
with its pid); ``restart.py`` SIGKILLs rank 1's process and reads when rank 0 steps again.

Needs Ray Train's own dependencies (``pip install -e '.[raytrain]'``: pandas, pyarrow, fsspec,
requests, pydantic), which graphdist does not.

    python _raytrain_run.py --out DIR [--steps 300] [--save-every 25]
"""

import argparse
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TASK = os.path.join(HERE, "_restart_task.py")


def loop(config):
    """Ray Train's ``train_loop_per_worker``: the task as ``python _restart_task.py ARGS``."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    sys.argv = [TASK, *config["args"]]
    runpy.run_path(TASK, run_name="__main__")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the backup and Ray's results")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25, metavar="STEPS")
    args = parser.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    env = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    ray.init(runtime_env={"env_vars": env}, include_dashboard=False)
    task_args = ["--out", args.out, "--steps", str(args.steps)]
    task_args += ["--save-every", str(args.save_every)]
    trainer = TensorflowTrainer(
        loop,
        train_loop_config={"args": task_args},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            name="restart",
            storage_path=os.path.join(args.out, "ray"),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    trainer.fit()
    print("ray train done", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
