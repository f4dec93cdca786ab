"""The code `trust_remote_code=True` runs for a model folder written by memattn.

memattn copies this file into every Hugging Face folder it writes (`memattn export-hf`,
`memattn convert`); config.json's `auto_map` names classes of this module, which are
memattn's own (memattn.integrations.hf and .convert), so memattn must be installed:

    pip install "memattn[hf]"

It holds no model code of its own: the folder loads exactly as after
`import memattn.integrations.hf`.
"""

import importlib
import importlib.util

try:
    _classes = importlib.import_module("memattn.integrations.hf")
except ImportError as e:
    if importlib.util.find_spec("memattn") is None:
        raise ImportError(
            "this model folder was written by memattn, whose classes it loads, and memattn is not "
            "installed: pip install 'memattn[hf]' (or, in a checkout of memattn, pip install -e '.[hf]')"
        ) from e
    raise


def __getattr__(name):
    return _classes.folder_class(name)
