"""An emulated multi-host cluster on one Linux machine (``mcrdl cluster``).

Each host is a network namespace with its own host name, joined to a software switch
(a bridge in a namespace of its own) by a veth pair shaped with ``tc`` in both
directions. Programs run on it once per rank through the venv's hydra ``mpiexec``,
block-placed on the hosts, with MPI and Gloo made to use the links between hosts.

    from mcrdl_core.cluster import Cluster, ClusterSpec, run_program
    with Cluster(ClusterSpec(hosts=2, ranks_per_host=2, rate_bits=10**9)) as c:
        status = run_program(c, ["python", "train.py"])
        print(c.counters())        # bytes each host sent and received on its link

Modules: ``spec`` (hosts, rates, names, addresses: pure data), ``system`` (ip, tc,
namespaces, counters), ``cluster`` (build, enter, tear down), ``launch`` (mpiexec and
the programs' environment), ``command`` (the CLI).
"""
from .cluster import Cluster, existing
from .errors import ClusterError, ClusterPermissionError, ClusterSpecError
from .launch import program_env, run_program
from .spec import ClusterSpec, parse_delay, parse_rate
from .system import why_not_allowed

__all__ = ["Cluster", "ClusterSpec", "ClusterError", "ClusterPermissionError",
           "ClusterSpecError", "existing", "parse_delay", "parse_rate", "program_env",
           "run_program", "why_not_allowed"]
