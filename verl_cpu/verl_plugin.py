"""The ``verl.plugins`` entry point: registers the CPU platform, and the actor's and critic's CPU engines
(``actor_engine.py``, ``value_engine.py``), in every process that imports verl.

verl imports each ``verl.plugins`` entry point at ``import verl`` (and ``VERL_USE_EXTERNAL_MODULES``
names modules to import the same way), which is what makes the registration reach every Ray worker.
Importing this module changes nothing unless ``VERL_PLATFORM=cpu``: GPU runs never see the platform or
the engine.
"""

import os


def cpu_platform_requested() -> bool:
    """True when the user selected verl's platform ``cpu`` (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


if cpu_platform_requested():
    from verl_cpu.platform import register_cpu_platform

    register_cpu_platform()  # first: importing verl's engines may already ask verl for the platform

    from verl_cpu.actor_engine import register_cpu_actor_engine
    from verl_cpu.value_engine import register_cpu_value_engine

    register_cpu_actor_engine()
    register_cpu_value_engine()
