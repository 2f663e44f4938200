import subprocess
import sys

from pdserve import __version__


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"pdserve {__version__}"
    assert __version__ == "0.1.0"
