"""Observers of calls: the debug checks (arguments compared across ranks) and the
communication logger. Imports the layers below ``dispatch``."""
