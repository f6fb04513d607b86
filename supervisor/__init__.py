"""Process control: spawn isolated, find whole trees, stop them and prove it.

Knows nothing of devices or tickets (``hold`` builds those on top of it).
"""

import os as _os

# The PyPI package "supervisor" (supervisord) installs a top-level package of
# the same name. In one environment the two merge into one folder without a
# word, and uninstalling either deletes files of the other. Refuse to run from
# such a folder (two stats: this runs on every start of npu-hold). Where
# supervisord was installed after us, its __init__.py has replaced this one:
# supervisor.identity then finds OURS missing and says the same.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
for _name in ("supervisord.py", "supervisorctl.py"):
    if _os.path.exists(_os.path.join(_HERE, _name)):
        raise ImportError(
            f"{_HERE} holds both hold's 'supervisor' package and the PyPI package "
            f"'supervisor' (supervisord; found {_name}): both install a top-level "
            "'supervisor' package, and in one environment they overwrite each other. "
            "Install supervisord in a separate virtual environment (e.g. "
            "'pipx install supervisor'); here, 'pip uninstall supervisor' and then "
            "reinstall hold ('pip install --force-reinstall hold'), since the "
            "uninstall removes files the two share."
        )

OURS = True  # checked by supervisor.identity: this __init__ is hold's, not supervisord's
