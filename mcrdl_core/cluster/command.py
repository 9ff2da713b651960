"""``mcrdl cluster run|up|exec|down|list``: the command line of the emulated cluster.

    mcrdl cluster run --hosts 2 --ranks-per-host 1 --rate 1gbit [--delay 50us] -- python train.py
    mcrdl cluster up --hosts 4 --rate 10gbit      # prints its name; stays up
    mcrdl cluster exec h1 -- ip addr              # a command inside host h1
    mcrdl cluster run --name N -- python train.py # on cluster N, made by `up`
    mcrdl cluster down                            # removes it

``run`` builds a cluster, runs the program on it and removes it, also on Ctrl-C and
on errors, and exits with the program's status; ``run --name N`` uses cluster N (made
by ``up``) and leaves it up.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .cluster import Cluster, existing
from .errors import ClusterSpecError
from .launch import run_program
from .spec import ClusterSpec, parse_delay, parse_rate


def add_parser(sub) -> None:
    """Add ``cluster`` and its subcommands to the ``mcrdl`` parser's subparsers."""
    p = sub.add_parser("cluster", help="an emulated multi-host cluster on this machine "
                                       "(network namespaces; needs root)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = p.add_subparsers(dest="cluster_cmd", required=True)

    def shape_args(q, with_hosts_default: bool):
        q.add_argument("--hosts", type=int, default=2 if with_hosts_default else None,
                       help="number of emulated hosts (2)")
        q.add_argument("--ranks-per-host", type=int, default=None,
                       help="ranks started on each host, block-placed (1)")
        q.add_argument("--rate", default="10gbit",
                       help="link rate of each host, each direction, in tc's units "
                            "(10gbit; 'none' = unshaped)")
        q.add_argument("--delay", default=None, help="one-way delay per link direction "
                                                     "(e.g. 50us; needs the kernel's netem)")

    q = csub.add_parser("run", help="build a cluster, run a program once per rank, remove it")
    shape_args(q, with_hosts_default=False)
    q.add_argument("--name", help="run on this cluster (made by `up`) instead of a new one")
    q.add_argument("--report", help="write a JSON report here: cluster, exit status, seconds, "
                                    "bytes each host sent and received on its link")
    q.add_argument("--timeout", type=float, default=None,
                   help="seconds after which the program is interrupted (exit 124)")
    q.add_argument("program", nargs=argparse.REMAINDER, help="-- program and its arguments")
    q.set_defaults(fn=cmd_run)

    q = csub.add_parser("up", help="build a cluster and leave it up (prints its name)")
    shape_args(q, with_hosts_default=True)
    q.add_argument("--name", help="its name (default: a fresh unique one)")
    q.set_defaults(fn=cmd_up)

    q = csub.add_parser("exec", help="run a command inside one host of a cluster that is up")
    q.add_argument("host", help="h0, h1, ... (or 'switch')")
    q.add_argument("--name", help="which cluster (needed when several are up)")
    q.add_argument("program", nargs=argparse.REMAINDER, help="-- command and its arguments")
    q.set_defaults(fn=cmd_exec)

    q = csub.add_parser("down", help="remove a cluster made by `up` (or left by a killed run)")
    q.add_argument("--name", help="which cluster (needed when several are up)")
    q.set_defaults(fn=cmd_down)

    q = csub.add_parser("list", help="the clusters that are up on this machine")
    q.set_defaults(fn=cmd_list)


def _program(args) -> list[str]:
    prog = list(args.program)
    if prog[:1] == ["--"]:
        prog = prog[1:]
    if not prog:
        raise ClusterSpecError("no command given: put it after `--`, e.g. "
                               "mcrdl cluster run --hosts 2 -- python train.py")
    return prog


def _spec(args, name=None) -> ClusterSpec:
    kw = {} if name is None else {"name": name}
    return ClusterSpec(hosts=args.hosts if args.hosts is not None else 2,
                       ranks_per_host=args.ranks_per_host or 1,
                       rate_bits=parse_rate(args.rate), delay_s=parse_delay(args.delay), **kw)


def cmd_run(args) -> int:
    program = _program(args)
    t0 = time.monotonic()
    if args.name:
        if args.hosts is not None:
            raise ClusterSpecError("--hosts describes a new cluster; with --name the program "
                                   "runs on that cluster as it was built (leave out --hosts)")
        cluster = Cluster.attach(args.name)
        print(f"mcrdl cluster: running on {cluster.summary()}", file=sys.stderr, flush=True)
        before = cluster.counters()
        rc = run_program(cluster, program, args.ranks_per_host, args.timeout)
        after = cluster.counters()
    else:
        spec = _spec(args)  # bad input fails here, before anything is built
        with Cluster(spec) as cluster:
            print(f"mcrdl cluster: built {cluster.summary()}", file=sys.stderr, flush=True)
            before = cluster.counters()
            rc = run_program(cluster, program, timeout_s=args.timeout)
            after = cluster.counters()
    moved = {h: {k: after[h][k] - before.get(h, {}).get(k, 0) for k in after[h]} for h in after}
    seconds = time.monotonic() - t0
    print("mcrdl cluster: link bytes " + "; ".join(
        f"{h} sent {c['sent_bytes'] / 2**20:.2f} MiB, "
        f"received {c['received_bytes'] / 2**20:.2f} MiB"
        for h, c in moved.items()) + f"; program exit status {rc}, {seconds:.1f} s",
        file=sys.stderr, flush=True)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({"cluster": cluster.spec.to_dict(), "machine": cluster.machine,
                       "program": program, "returncode": rc, "seconds": seconds,
                       "links": moved}, f, indent=1)
    return rc


def cmd_up(args) -> int:
    cluster = Cluster(_spec(args, args.name)).build()
    cluster.keep()
    print(cluster.spec.name)
    name = cluster.spec.name
    print(f"mcrdl cluster: up: {cluster.summary()}\n"
          f"  run on it:  mcrdl cluster run --name {name} -- PROGRAM\n"
          f"  one host:   mcrdl cluster exec --name {name} h0 -- COMMAND\n"
          f"  remove it:  mcrdl cluster down --name {name}", file=sys.stderr)
    return 0


def cmd_exec(args) -> int:
    cluster = Cluster.attach(args.name)
    return cluster.exec(args.host, _program(args))


def cmd_down(args) -> int:
    cluster = Cluster.attach(args.name)
    cluster.teardown()
    print(f"mcrdl cluster: removed {cluster.spec.name}", file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    for name in existing():
        try:
            print(Cluster.attach(name).summary())
        except ClusterSpecError as exc:
            print(f"{name}: unreadable state ({exc})")
    return 0
