"""The plug-in's switch: ``DSA_ASYNC_SGLANG=1`` in the environment turns it on.

Read when SGLang calls ``register()`` and again when SGLang builds the cache (strategy.py), so
a process that loaded the plug-in with the variable set and builds without it gets SGLang's
own cache. Pure; never blocks.
"""

from __future__ import annotations

import os

#: The environment variable that turns the plug-in on ("1").
OPT_IN_VARIABLE = "DSA_ASYNC_SGLANG"


def opted_in() -> bool:
    """Whether ``DSA_ASYNC_SGLANG=1`` is set now."""
    return os.environ.get(OPT_IN_VARIABLE, "").strip() == "1"
