import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "services" / "pdserve" / "api" / "v1"


def test_committed_stubs_match_the_protos(tmp_path):
    out = tmp_path / "v1"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in COMMITTED.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "run `make protos` and commit the stubs"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}: run `make protos`"


def test_stubs_import_from_the_installed_package():
    from pdserve.api.v1 import common_pb2

    params = common_pb2.SamplingParams(temperature=0.5, max_tokens=8, stop=["\n"])
    decoded = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.max_tokens == 8 and list(decoded.stop) == ["\n"]
    assert not decoded.HasField("seed")
