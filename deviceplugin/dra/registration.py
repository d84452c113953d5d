"""Where the kubelet finds the driver, and the plugin-registration service it asks there.

The kubelet watches `<kubelet root>/plugins_registry` for Unix sockets; on ours it calls GetInfo (1 s deadline) and
then NotifyRegistrationStatus. GetInfo names the driver, the absolute path of the DRA socket and the services in
our order of preference, v1 first: a 1.34+ kubelet takes the first it knows (v1), a 1.32/1.33 kubelet v1beta1.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from ..api import pluginregistration_v1_pb2 as reg_pb
from ..api import pluginregistration_v1_pb2_grpc as reg_grpc
from ..errors import StartupError
from ..logs import safe_text

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
CHECKPOINT_DIR = "claims"


@dataclass(frozen=True)
class PluginPaths:
    """The driver's sockets and files. With `instance` (the pod UID, for a rolling update: two instances side by
    side, kubelet >= 1.33) both socket names carry it; the data directory, its checkpoint and lock are shared."""

    registrar_dir: Path  # <kubelet root>/plugins_registry
    plugins_dir: Path  # <kubelet root>/plugins
    driver: str
    instance: str = ""

    @property
    def data_dir(self) -> Path:
        return self.plugins_dir / self.driver

    @property
    def dra_socket(self) -> Path:
        return self.data_dir / (f"dra-{self.instance}.sock" if self.instance else "dra.sock")

    @property
    def registration_socket(self) -> Path:
        return self.registrar_dir / (
            f"{self.driver}-{self.instance}-reg.sock" if self.instance else f"{self.driver}-reg.sock"
        )

    @property
    def checkpoint(self) -> Path:
        return self.data_dir / CHECKPOINT_DIR

    def check(self) -> None:
        """StartupError when a socket path is longer than the kernel allows or not absolute."""
        for path in (self.dra_socket, self.registration_socket):
            if not path.is_absolute():
                raise StartupError(f"DRA socket path {path} is not absolute")
            if len(str(path).encode()) > MAX_SOCKET_PATH:
                raise StartupError(
                    f"DRA socket path {path} is longer than {MAX_SOCKET_PATH} bytes: use shorter kubelet directories"
                )


class Registration(reg_grpc.RegistrationServicer):
    """GetInfo and NotifyRegistrationStatus; `registered` is set once the kubelet says it registered us."""

    def __init__(self, driver: str, endpoint: Path) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.last_error = ""

    async def GetInfo(self, request: reg_pb.InfoRequest, context: object) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver, endpoint=str(self.endpoint), supported_versions=list(SUPPORTED_VERSIONS)
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: object
    ) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            if not self.registered.is_set():
                log.info("registered with the kubelet as DRA driver %s", self.driver)
            self.last_error = ""
            self.registered.set()
        else:
            self.registered.clear()
            self.last_error = safe_text(request.error, 500)
            log.error("the kubelet refused DRA driver %s: %s (it retries)", self.driver, self.last_error)
        return reg_pb.RegistrationStatusResponse()
