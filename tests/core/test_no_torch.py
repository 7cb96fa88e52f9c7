"""chatserve.core must import (and run) with torch unavailable."""
import subprocess
import sys

CODE = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in chatserve.core")
        return None
sys.meta_path.insert(0, Block())
import chatserve.core, chatserve.core.request, chatserve.core.outputs
import pkgutil, importlib
for m in pkgutil.iter_modules(chatserve.core.__path__):
    importlib.import_module("chatserve.core." + m.name)
assert "torch" not in sys.modules
print("ok")
"""


def test_core_imports_without_torch():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
