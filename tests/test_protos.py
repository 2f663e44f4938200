import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "services" / "pdserve" / "api"
STUB_PACKAGES = ("v1", "inference")


@pytest.fixture(scope="module")
def fresh_stubs(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.mark.parametrize("package", STUB_PACKAGES)
def test_committed_stubs_match_the_protos(fresh_stubs, package):
    fresh = {p.name: p.read_text() for p in (fresh_stubs / package).iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in (API / package).iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "run `make protos` and commit the stubs"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}: run `make protos`"


def test_stubs_import_from_the_installed_package():
    from pdserve.api.v1 import common_pb2

    params = common_pb2.SamplingParams(temperature=0.5, max_tokens=8, stop=["\n"])
    decoded = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.max_tokens == 8 and list(decoded.stop) == ["\n"]
    assert not decoded.HasField("seed")


def test_the_kserve_stubs_load_beside_tritonclients_and_speak_its_wire_format():
    # tritonclient registers the same message names in protobuf's default pool: ours live
    # in a pool of their own, so one process loads both, in either order.
    probe = (
        "import tritonclient.grpc.service_pb2 as theirs\n"
        "from pdserve.api.inference import grpc_service_pb2 as ours, model_config_pb2\n"
        "config = model_config_pb2.ModelConfig(name='m', max_batch_size=0)\n"
        "config.model_transaction_policy.decoupled = True\n"
        "data = ours.ModelConfigResponse(config=config).SerializeToString()\n"
        "parsed = theirs.ModelConfigResponse.FromString(data)\n"
        "assert parsed.config.name == 'm' and parsed.config.model_transaction_policy.decoupled\n"
    )
    for order in (probe, "import pdserve.api.inference.grpc_service_pb2\n" + probe):
        subprocess.run([sys.executable, "-c", order], check=True, capture_output=True)
