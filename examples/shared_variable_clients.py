"""Two separate client processes share one variable that lives on task 0 of a fleet.

The first client declares ``counter`` with ``graphdist.shared_variable``, initializes it only if
the server says it is uninitialized, and adds 1.0. The second client declares the same name and
device, runs no initializer at all, and reads 1.0. ``--ref`` runs both clients with ref variables
(``disable_v2_behavior``) instead of resource variables.

    python examples/shared_variable_clients.py [--ref]
"""

import argparse
import json
import subprocess
import sys

import graphdist


def client(role, cluster_json, ref):
    import tensorflow.compat.v1 as tf

    if ref:
        tf.disable_v2_behavior()
    else:
        tf.disable_eager_execution()
    cluster = graphdist.Cluster.parse(cluster_json)
    counter = graphdist.shared_variable("counter", 0.0, "/job:local/task:0")
    with graphdist.session(cluster.target("local", 1)) as sess:
        if role == "increment":
            initialized = graphdist.initialize_uninitialized(sess)
            value = sess.run(counter.assign_add(1.0))
            print(f"client 1: initialized {initialized}, incremented counter to {value}")
        else:
            print(f"client 2: read counter = {sess.run(counter)} without initializing")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", action="store_true", help="use ref variables")
    parser.add_argument("--role", choices=["increment", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        client(args.role, args.cluster, args.ref)
        return
    with graphdist.LocalFleet("local=2") as fleet:
        cluster_json = json.dumps(fleet.cluster.as_dict())
        for role in ("increment", "read"):
            argv = [sys.executable, __file__, "--role", role, "--cluster", cluster_json]
            subprocess.run(argv + (["--ref"] if args.ref else []), check=True, timeout=120)


if __name__ == "__main__":
    main()
