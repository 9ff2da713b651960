"""The flight recorder's dump also in torch's flight-recorder format (being written)."""
from __future__ import annotations


def write(data: dict, json_path: str) -> str | None:
    """Write ``data`` (``recorder.snapshot``'s dict) beside ``json_path`` in torch's
    format; return the path written, or None. Never raises."""
    return None
