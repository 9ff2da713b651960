"""The world: processes, groups, the Backend contract and registry, bootstrap over
MPI or a store. Imports ``base``, ``engine`` and ``memory``."""
