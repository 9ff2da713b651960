"""Tools on top of everything: the tuner (``mcrdl tune``), sweeps, straggler reports
and the ``mcrdl`` command line. ``mcrdl_core.cluster`` (the emulated cluster) sits
beside it."""
