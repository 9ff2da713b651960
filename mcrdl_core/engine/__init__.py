"""The progress engine and Work handles: in-flight work of every library is polled
from one loop, with timeouts and failure wrapping. Knows no backend and no buffer;
imports only ``base``."""
