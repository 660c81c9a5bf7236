"""The image's HEALTHCHECK finds the service a container runs and asks its /health."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from ctxcache.healthcheck import health_url, main
from tests.deploy.manifests import interpolate, load_compose

VENV = "/opt/venv/bin/"


@pytest.mark.parametrize(
    ("argv", "env", "url"),
    [
        ([VENV + "python", VENV + "ctxcache", "gateway", "--port", "8000"], {}, 8000),
        ([VENV + "python", VENV + "ctxcache", "gateway"], {"CTX_GATEWAY_PORT": "9000"}, 9000),
        ([VENV + "python", VENV + "ctxcache", "manager"], {}, 8300),
        (["ctxcache", "sidecar", "--port", "65432", "--control-port", "8201"], {}, 8201),
        (["ctxcache", "sidecar"], {"CTX_SIDECAR_CONTROL_PORT": "8202"}, 8202),
        (["ctxcache", "worker", "--model", "/m", "--port=8101"], {}, 8101),
        (["ctxcache", "serve"], {}, 8000),
        # `ctxcache vllm` has replaced itself with vLLM's server
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8100"], {}, 8100),
    ],
)
def test_health_url_is_the_port_the_service_listens_on(
    argv: list[str], env: dict[str, str], url: int
) -> None:
    assert health_url(argv, env) == f"http://127.0.0.1:{url}/health"


def test_one_shot_commands_have_nothing_to_check() -> None:
    assert health_url(["ctxcache", "model", "create", "--preset", "tiny", "/m"], {}) is None
    assert health_url(["sh", "-c", "true"], {}) is None
    assert health_url(["ctxcache"], {}) is None


def test_healthcheck_url_overrides() -> None:
    env = {"HEALTHCHECK_URL": "http://127.0.0.1:1/ready"}
    assert health_url(["ctxcache", "gateway"], env) == "http://127.0.0.1:1/ready"


def test_every_compose_service_of_the_image_gets_a_url() -> None:
    for name, svc in load_compose()["services"].items():
        if "ctxcache" not in svc.get("image", "") or name == "model-init":
            continue
        argv = ["ctxcache", *[interpolate(str(a)) for a in svc["command"]]]
        assert health_url(argv, {}) is not None, name


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_main_is_healthy_only_when_the_service_answers(server: int) -> None:
    assert main(["ctxcache", "manager", "--port", str(server)]) == 0
    assert main(["ctxcache", "manager", "--port", str(closed_port())]) == 1
    assert main(["ctxcache", "model", "create", "/m"]) == 0
