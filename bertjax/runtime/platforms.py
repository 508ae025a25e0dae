"""Which JAX platforms this machine can run, decided before JAX starts (JAX decides the same way later).

Installing an accelerator's package does not give the machine the accelerator: `jax[tpu]` (libtpu) is installed
on CPU machines too, to compile for TPU topologies ahead of time. JAX then still runs on the CPU, but probes for
TPU chips at start (mapping libtpu, +250 MiB, error lines on stderr). So the chips are looked for on the PCI bus,
as JAX's own hardware check does (jax/_src/hardware_utils.py), not inferred from the package.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping, MutableMapping

# Google's PCI vendor id; gVNIC network cards share it, so the device id must be a TPU's too.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICE_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def tpu_chips_present(pci_devices: str = "/sys/bus/pci/devices") -> bool:
    """True when a TPU chip is on this machine's PCI bus."""
    if not os.path.isdir(pci_devices):
        return False
    for device in os.listdir(pci_devices):
        try:
            with open(os.path.join(pci_devices, device, "vendor")) as vendor_file, \
                    open(os.path.join(pci_devices, device, "device")) as device_file:
                if vendor_file.read().strip() == _GOOGLE_PCI_VENDOR and \
                        device_file.read().strip() in _TPU_PCI_DEVICE_IDS:
                    return True
        except OSError:
            continue
    return False


def _gpu_plugin_installed() -> bool:
    return (bool(importlib.metadata.entry_points(group="jax_plugins"))
            or importlib.util.find_spec("jax_plugins") is not None)


def jax_runs_on_cpu_only(environ: Mapping[str, str]) -> bool:
    """True when JAX in this process can only pick the CPU backend (decided without initialising JAX)."""
    platforms = {name.strip() for name in environ.get("JAX_PLATFORMS", "").split(",") if name.strip()}
    if platforms:
        return platforms == {"cpu"}
    tpu = importlib.util.find_spec("libtpu") is not None and (
        "JAX_FORCE_TPU_INIT" in environ or tpu_chips_present())
    gpu = _gpu_plugin_installed() and any(os.path.exists(path) for path in _GPU_DEVICE_FILES)
    return not tpu and not gpu


def use_cpu_where_no_accelerator(environ: MutableMapping[str, str]) -> bool:
    """Sets JAX_PLATFORMS=cpu (unless the user set JAX_PLATFORMS) where JAX can only run on the CPU, so JAX does
    not probe for accelerators whose packages are installed but whose hardware is absent. True if set."""
    if "JAX_PLATFORMS" in environ or not jax_runs_on_cpu_only(environ):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True


def skip_accelerator_plugins(environ: Mapping[str, str]) -> bool:
    """Where JAX may only use the CPU (JAX_PLATFORMS=cpu), JAX's start-up does not load the accelerator plugins
    that are installed: JAX imports every one anyway (the CUDA plugin maps its CUDA libraries, +560 MiB of
    resident memory, ~0.1 CPU-s) and then leaves it unused. Call before JAX's first device query; True if skipped.
    Not for `bertjax compile`, which compiles for GPUs through the CUDA plugin on a CPU machine."""
    if environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
        return False
    from jax._src import xla_bridge  # jax is pinned: its discovery runs once, behind this flag

    xla_bridge._plugins_registered = True
    return True
