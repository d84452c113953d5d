"""The compute mode of an MPS pool's GPUs (`exclusiveProcess: true`): EXCLUSIVE_PROCESS while the pool's control
daemon serves, so only the MPS server opens a context on them, and the mode each GPU had restored when it quits.

NVML (pynvml) is loaded only when a pool asks for it; setting the mode needs root, as `nvidia-smi -c` does.
"""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger(__name__)


class ComputeModeError(RuntimeError):
    """The mode could not be read or set: the message names the GPU and NVML's cause."""


class ComputeModes:
    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml  # the pynvml module (tests give a fake); imported on first use

    def _module(self) -> ModuleType:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def make_exclusive(self, uuids: list[str]) -> dict[str, int]:
        """Set EXCLUSIVE_PROCESS on these GPUs; the modes they had before (to `restore`). A failure restores those
        already changed and raises ComputeModeError."""
        nvml = self._module()
        before: dict[str, int] = {}
        with self._session() as handle:
            try:
                for uuid in uuids:
                    mode = nvml.nvmlDeviceGetComputeMode(handle(uuid))
                    if mode != nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                        nvml.nvmlDeviceSetComputeMode(handle(uuid), nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
                        before[uuid] = mode
                        log.info("GPU %s: compute mode EXCLUSIVE_PROCESS (was %s)", uuid, _name(nvml, mode))
            except nvml.NVMLError as err:
                self._set(handle, before)
                raise ComputeModeError(
                    f"GPU {uuid}: cannot set compute mode EXCLUSIVE_PROCESS: {err} (needs root and NVML)"
                ) from None
        return before

    def restore(self, before: dict[str, int]) -> None:
        """Put back the modes `make_exclusive` changed; a GPU that refuses is logged, the others are still restored."""
        if before:
            with self._session() as handle:
                self._set(handle, before)

    def _set(self, handle, modes: dict[str, int]) -> None:
        nvml = self._module()
        for uuid, mode in modes.items():
            try:
                nvml.nvmlDeviceSetComputeMode(handle(uuid), mode)
                log.info("GPU %s: compute mode %s again", uuid, _name(nvml, mode))
            except nvml.NVMLError as err:
                log.error("GPU %s: cannot restore compute mode %s: %s", uuid, _name(nvml, mode), err)

    def _session(self):
        return _Session(self._module())


class _Session:
    """nvmlInit ... nvmlShutdown, handing out device handles by UUID."""

    def __init__(self, nvml: ModuleType) -> None:
        self.nvml = nvml

    def __enter__(self):
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as err:
            raise ComputeModeError(f"NVML could not be loaded to set compute modes: {err}") from None
        return lambda uuid: self.nvml.nvmlDeviceGetHandleByUUID(uuid)

    def __exit__(self, *exc: object) -> None:
        self.nvml.nvmlShutdown()


def _name(nvml: ModuleType, mode: int) -> str:
    names = {
        nvml.NVML_COMPUTEMODE_DEFAULT: "DEFAULT",
        nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS",
        nvml.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED",
    }
    return names.get(mode, str(mode))
