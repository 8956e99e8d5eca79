"""dflash-serve: an OpenAI-compatible server for a target + DFlash drafter pair.

``protocol`` (request checking, response shapes), ``worker`` (the thread that owns the pair),
``metrics`` (Prometheus counters), ``handler`` (HTTP), ``app`` (``DFlashServer`` and the CLI).
"""
